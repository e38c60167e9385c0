"""Mixture of experts: top-k routing, and every expert's gated MLP in one layer.

:class:`FusedMoE` stacks the experts' weights into two tensors, ``w13_weight``
``[experts, 2 * intermediate, hidden]`` (each expert's gate rows, then its up
rows) and ``w2_weight`` ``[experts, hidden, intermediate]``, loaded from the
checkpoint's per-expert tensors. It routes and computes all experts in one call to the
platform's :meth:`dovetail.ops.FusedOps.routed_moe` (:meth:`~dovetail.ops.FusedOps.select_experts`
then :meth:`~dovetail.ops.FusedOps.fused_moe`, unless the platform fuses them); the math and its
definition are in :mod:`dovetail.moe_ops`.

FP8 experts come from an FP8 checkpoint (``quant_method: fp8``: per-tensor
``weight_scale`` or 128 x 128 block ``weight_scale_inv``, dynamic activations) or
are quantized per channel at load (``--quantization fp8``).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from dovetail.checkpoint_tensor import read
from dovetail.distributed import all_reduce, tp_rank, tp_size
from dovetail.distributed.partition import divide
from dovetail.errors import ConfigError, ModelLoadError, SelectionError
from dovetail.model_interface import ModelContext
from dovetail.moe_ops import ACTIVATIONS, ExpertOutputs, Fp8ExpertScales
from dovetail.quantization import quant_ops
from dovetail.quantization.params import replace_param

#: (weight, scale) parameter names of the two stacked projections.
_SCALE_OF = {"w13_weight": "w13_weight_scale", "w2_weight": "w2_weight_scale"}


def rank_expert_map(num_experts: int) -> torch.Tensor:
    """Expert parallelism over the tensor-parallel ranks: rank ``r`` holds experts ``[r * E / tp, (r + 1) * E / tp)``
    as its rows ``0 .. E / tp - 1``; the others are ``-1``."""
    per_rank = divide(num_experts, "num_experts")
    mapping = torch.full((num_experts,), -1, dtype=torch.int32)
    start = tp_rank() * per_rank
    mapping[start:start + per_rank] = torch.arange(per_rank, dtype=torch.int32)
    return mapping


class FusedMoE(nn.Module):
    """The experts of one mixture-of-experts block; ``forward(x, router_logits)`` routes and runs them.

    - ``top_k``: experts per token; ``renormalize``: rescale the chosen
      experts' probabilities to sum to 1 (HF's ``norm_topk_prob``; Mixtral always does).
    - ``expert_map``: for expert parallelism, global expert id -> row of this layer's
      weights, ``-1`` for the experts another rank holds (None: all ``num_experts`` here,
      or, under tensor parallelism, :func:`rank_expert_map`'s consecutive share of them).
      Checkpoint tensors of experts held elsewhere are skipped at load (never read).
    - Under tensor parallelism every rank routes every token alike (the router is
      replicated); an expert held elsewhere adds nothing on this rank and an all-reduce
      sums the ranks' parts (``reduce_results=False`` leaves the partial sum to the caller).
    - ``leave_sum_to_norm``: the output goes straight into a norm (:class:`dovetail.layers.norm.RMSNorm`), which
      may then receive the experts' outputs before their weighted sum and sum them in its own kernel
      (:meth:`dovetail.ops.FusedOps.routed_moe_unsummed`); only where no expert map and no all-reduce apply.
    - Checkpoint tensors load per expert through :meth:`load_expert` (gate,
      up and down projections, and FP8 scales) or whole through :meth:`load_stacked`.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 ctx: ModelContext, prefix: str = "", renormalize: bool = True, activation: str = "silu",
                 expert_map: Sequence[int] | torch.Tensor | None = None, reduce_results: bool = True):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ModelLoadError(f"{prefix}: num_experts_per_tok must be between 1 and the number of experts "
                                 f"({num_experts}), got {top_k}")
        if activation not in ACTIVATIONS:
            raise ModelLoadError(f"{prefix}: hidden_act {activation!r} is not supported by the MoE layer "
                                 f"(supported: {', '.join(ACTIVATIONS)})")
        self.fp8_scheme = None
        if ctx.quant.name != "none" and ctx.quant.quantizes(prefix):
            self.fp8_scheme = ctx.quant.expert_fp8_scheme(prefix)
            if self.fp8_scheme is None:
                raise SelectionError(f"quantization {ctx.quant.name!r} cannot run this model: it does not quantize "
                                     f"mixture-of-experts layers ({prefix})")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation = activation
        self.prefix = prefix
        self.ops = ctx.ops
        if expert_map is None and tp_size() > 1:
            expert_map = rank_expert_map(num_experts)
        self.expert_map = self._check_expert_map(expert_map, num_experts, prefix)
        self.reduce_results = reduce_results and tp_size() > 1
        self.leave_sum_to_norm = False
        self.local_experts = num_experts if self.expert_map is None else int((self.expert_map >= 0).sum())
        if self.expert_map is not None:
            self.register_buffer("expert_map_device", self.expert_map.to(ctx.device), persistent=False)
        scheme = self.fp8_scheme
        weight_dtype = quant_ops.fp8_dtype() if scheme is not None and scheme.serialized else ctx.dtype
        e = self.local_experts
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * intermediate_size, hidden_size, dtype=weight_dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, hidden_size, intermediate_size, dtype=weight_dtype),
                                      requires_grad=False)
        self._loaded: dict[str, set] = {name: set() for name in ("w13_weight", "w2_weight")}
        if scheme is not None and scheme.serialized:
            self._add_scales(scheme, e)

    @staticmethod
    def _check_expert_map(expert_map, num_experts: int, prefix: str) -> torch.Tensor | None:
        if expert_map is None:
            return None
        mapping = torch.as_tensor(expert_map, dtype=torch.int32).cpu()
        local = sorted(int(v) for v in mapping if v >= 0)
        if mapping.shape != (num_experts,) or local != list(range(len(local))) or not local:
            raise ModelLoadError(f"{prefix}: expert_map must give each of the {num_experts} experts a row 0, 1, ... "
                                 f"of this rank's weights or -1, with at least one row (got {mapping.tolist()})")
        return mapping

    def _add_scales(self, scheme, experts: int) -> None:
        if scheme.block_size is None:
            shapes = {"w13_weight_scale": (experts, 2 * self.intermediate_size),
                      "w2_weight_scale": (experts, self.hidden_size)}
        else:
            bn, bk = scheme.block_size
            if self.intermediate_size % bn:
                raise ConfigError(f"quantization_config.weight_block_size: {self.prefix} merges gate and up "
                                  f"projections of {self.intermediate_size} rows, which must be a multiple of the "
                                  f"block's {bn} rows")
            shapes = {"w13_weight_scale": (experts, 2 * self.intermediate_size // bn, -(-self.hidden_size // bk)),
                      "w2_weight_scale": (experts, -(-self.hidden_size // bn), -(-self.intermediate_size // bk))}
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False))
            self._loaded[name] = set()

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor | ExpertOutputs:
        if self.leave_sum_to_norm and self.expert_map is None and not self.reduce_results:
            return self.ops.routed_moe_unsummed(x, router_logits, self.w13_weight, self.w2_weight, self.top_k,
                                                self.renormalize, self.activation, fp8=self.fp8_scales())
        expert_map = self.expert_map_device if self.expert_map is not None else None
        out = self.ops.routed_moe(x, router_logits, self.w13_weight, self.w2_weight, self.top_k, self.renormalize,
                                  self.activation, expert_map=expert_map, fp8=self.fp8_scales())
        return all_reduce(out) if self.reduce_results else out

    def fp8_scales(self) -> Fp8ExpertScales | None:
        """The FP8 experts' scales (None for 16/32-bit experts)."""
        if self.w13_weight.dtype != quant_ops.fp8_dtype():
            return None
        return Fp8ExpertScales(self.w13_weight_scale, self.w2_weight_scale, self.fp8_scheme.block_size)

    # -- loading ---------------------------------------------------------------------------

    def load_expert(self, param_name: str, tensor: torch.Tensor, expert: int, shard: int | None, name: str) -> bool:
        """Copy one expert's checkpoint tensor: ``w13_weight`` shard 0 (gate) or 1 (up), or ``w2_weight``, or
        their FP8 scales (``w13_weight_scale``, ``w2_weight_scale``).

        Returns True once every held expert's part of ``param_name`` is loaded.
        """
        if not 0 <= expert < self.num_experts:
            raise ModelLoadError(f"tensor {name!r} names expert {expert}, but {self.prefix} has "
                                 f"{self.num_experts} experts (num_experts in config.json)")
        if param_name not in self._loaded:
            raise ModelLoadError(f"unexpected tensor {name!r} in the checkpoint: {self.prefix} has no "
                                 f"{param_name} ({'16/32-bit' if self.fp8_scheme is None else 'FP8'} experts)")
        row = expert if self.expert_map is None else int(self.expert_map[expert])
        if row >= 0:
            target = getattr(self, param_name).data[row]
            if param_name.endswith("_scale"):
                self._copy_scale(target, tensor, shard, name, param_name)
            else:
                if shard is not None:
                    target = target.narrow(0, shard * self.intermediate_size, self.intermediate_size)
                what = f"{param_name}[{expert}]" + (f" shard {shard}" if shard is not None else "")
                self._copy(target, tensor, name, what)
        self._loaded[param_name].add((expert, shard))
        parts = 2 if param_name.startswith("w13") else 1
        return len(self._loaded[param_name]) == self.num_experts * parts

    def _copy_scale(self, target: torch.Tensor, tensor: torch.Tensor, shard: int | None, name: str,
                    param_name: str) -> None:
        """A per-tensor, per-channel or block scale into this expert's rows of the stacked scale."""
        rows = target.shape[0] // (2 if shard is not None else 1)
        if shard is not None:
            target = target.narrow(0, shard * rows, rows)
        if self.fp8_scheme.block_size is not None:
            self._copy(target, tensor, name, f"{param_name} block scales")
            return
        flat = read(tensor).reshape(-1)
        if flat.numel() not in (1, rows):
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}: expected one per-tensor scale "
                                 f"or {rows} per-channel scales for {self.prefix}.{param_name}")
        target.copy_(flat.expand(rows))

    def load_stacked(self, param_name: str, tensor: torch.Tensor, name: str) -> bool:
        """Copy a checkpoint tensor holding every expert at once (transformers 5's own layout)."""
        target = getattr(self, param_name).data
        if self.expert_map is not None:
            held = (self.expert_map >= 0).nonzero().flatten()
            if tuple(tensor.shape[:1]) == (self.num_experts,):
                first, count = int(held[0]), len(held)
                if held.tolist() == list(range(first, first + count)):  # read only those experts
                    tensor = tensor.narrow(0, first, count)
                else:
                    tensor = read(tensor).index_select(0, held)
        self._copy(target, tensor, name, param_name)
        return True

    def _copy(self, target: torch.Tensor, tensor: torch.Tensor, name: str, what: str) -> None:
        if tuple(target.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, but {self.prefix}.{what} "
                                 f"expects {tuple(target.shape)}")
        target.copy_(read(tensor))

    def process_weights_after_loading(self) -> None:
        """``--quantization fp8`` on a 16/32-bit checkpoint: each expert to FP8 with one scale per output channel."""
        if self.fp8_scheme is None or self.fp8_scheme.serialized:
            return
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(self, name).data
            parts = [quant_ops.quantize_fp8_per_channel(weight[e]) for e in range(weight.shape[0])]
            replace_param(self, name, torch.stack([q for q, _ in parts]))
            replace_param(self, _SCALE_OF[name], torch.stack([s for _, s in parts]))

    def extra_repr(self) -> str:
        local = "" if self.expert_map is None else f" ({self.local_experts} here)"
        fp8 = "" if self.fp8_scheme is None else ", fp8"
        return (f"experts={self.num_experts}{local}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"inter={self.intermediate_size}, renormalize={self.renormalize}, act={self.activation}{fp8}")
