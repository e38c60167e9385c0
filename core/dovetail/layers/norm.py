"""RMSNorm, fused with the residual add through the platform's ops (and with the all-reduce before it under
tensor parallelism, where the platform's all-reduce kernel can); LayerNorm for the models that use it."""

from __future__ import annotations

import torch
from torch import nn

from dovetail.distributed import all_reduce, all_reduce_add_rms_norm
from dovetail.model_interface import ModelContext
from dovetail.moe_ops import ExpertOutputs


class RMSNorm(nn.Module):
    """RMSNorm; ``forward(x, residual)`` adds the residual first and returns both.

    ``weight_offset=1.0`` gives Gemma's ``(1 + weight)`` form: the offset is folded
    into a float32 weight after loading, so the multiply happens in float32 as HF does.

    ``all_reduce_input``: ``x`` is a rank's partial sum (a row-parallel layer left it unreduced) and the norm
    sums it over the ranks first, in one kernel with the residual add and the norm where the platform has one.

    ``x`` may be a mixture of experts' outputs before their weighted sum (:class:`~dovetail.moe_ops.ExpertOutputs`,
    from a layer that left the sum to its norm): the platform's ops sum them with the residual add and the norm.
    """

    def __init__(self, hidden_size: int, eps: float, ctx: ModelContext, weight_offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.ops = ctx.ops
        self.weight_offset = weight_offset
        dtype = torch.float32 if weight_offset else ctx.dtype
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_offset = weight_offset
        self.all_reduce_input = False

    def process_weights_after_loading(self) -> None:
        if self.weight_offset:
            self.weight.data.add_(self.weight_offset)

    def forward(self, x: torch.Tensor | ExpertOutputs, residual: torch.Tensor | None = None):
        if isinstance(x, ExpertOutputs):
            if residual is not None and not self.all_reduce_input:
                return self.ops.add_rms_norm_experts(x, residual, self.weight, self.eps)
            x = x.summed()
        if self.all_reduce_input:
            if residual is not None:
                return all_reduce_add_rms_norm(x, residual, self.weight, self.eps, self.ops.add_rms_norm)
            x = all_reduce(x)
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class LayerNorm(nn.Module):
    """LayerNorm (with a bias unless ``bias=False``); ``forward(x, residual)`` adds the residual first and
    returns both, as :class:`RMSNorm` does. Computed in float32, through torch."""

    def __init__(self, hidden_size: int, eps: float, ctx: ModelContext, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=ctx.dtype), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(hidden_size, dtype=ctx.dtype), requires_grad=False) if bias
                     else None)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.float() if self.bias is not None else None
        return torch.nn.functional.layer_norm(x.float(), x.shape[-1:], self.weight.float(), bias,
                                              self.eps).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
