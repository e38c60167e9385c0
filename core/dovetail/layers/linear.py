"""Linear layers whose weights come from the model's quantization method.

:class:`Linear` covers plain and merged projections: a merged layer (QKV,
gate/up) has several ``output_sizes`` and loads each from its own checkpoint
tensor by shard index, or all at once from a fused checkpoint tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from dovetail.errors import ModelLoadError
from dovetail.model_interface import ModelContext
from dovetail.quantization.kernels import QuantKernels
from dovetail.quantization.unquantized import UnquantizedMethod

_DEFAULT_KERNELS = QuantKernels()


class Linear(nn.Module):
    """``y = x @ W.T + b`` through the quantization hook; ``output_sizes`` are its shards."""

    def __init__(self, input_size: int, output_sizes: int | list[int], bias: bool, ctx: ModelContext,
                 prefix: str = ""):
        super().__init__()
        self.input_size = input_size
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.output_size = sum(self.output_sizes)
        self.prefix = prefix
        #: The platform's quantization kernels (``Platform.quant_kernels()``), which quantized methods call.
        self.quant_kernels = ctx.quant_kernels or _DEFAULT_KERNELS
        #: The platform's fused ops; the unquantized method calls their ``linear``.
        self.ops = ctx.ops
        self.method = ctx.quant if ctx.quant.quantizes(prefix) else UnquantizedMethod()
        self.method.create_weights(self, input_size, self.output_sizes, ctx.dtype)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size, dtype=ctx.dtype), requires_grad=False)
            self.bias.output_dim = 0
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)

    def forward_gated(self, x: torch.Tensor, activation: nn.Module) -> torch.Tensor:
        """``activation(self(x))`` for a gated activation over this merged ``[gate | up]`` layer: one kernel
        where the quantization method has one for the activation's ``name``, else the two steps."""
        name = getattr(activation, "name", None)
        fused = self.method.apply_gated(self, x, self.bias, name) if name else None
        return activation(self.forward(x)) if fused is None else fused

    def load_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard: int | None, name: str) -> None:
        """Copy checkpoint ``tensor`` into ``param``: whole (``shard=None``) or as output shard ``shard``."""
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            loader(param, tensor, shard)
            return
        target = param.data
        output_dim = getattr(param, "output_dim", None)
        if shard is not None and output_dim is not None:
            scale_num, scale_den = target.shape[output_dim], self.output_size
            start = sum(self.output_sizes[:shard]) * scale_num // scale_den
            length = self.output_sizes[shard] * scale_num // scale_den
            target = target.narrow(output_dim, start, length)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, but parameter "
                                 f"{self.prefix}.{_param_name(self, param)} expects {tuple(target.shape)}"
                                 + (f" for shard {shard}" if shard is not None else ""))
        target.copy_(tensor)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_sizes}, method={self.method.name}"


def _param_name(module: nn.Module, param: nn.Parameter) -> str:
    for name, p in module.named_parameters(recurse=False):
        if p is param:
            return name
    return "?"
