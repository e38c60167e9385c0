"""The LoRA slots of one linear layer, and the update they add to its output.

Every slot holds one adapter's ``A`` and ``B`` (zero-padded to ``max_lora_rank``), stacked so that a step
with tokens of several adapters costs two dense products whatever the mix: the input times every slot's
``A`` at once (``[tokens, parts * slots * rank]``), zeroed outside each token's slot by the step's one-hot
mask (:mod:`dovetail.lora.context`), then times the stacked ``B`` of each merged part. The shapes never
depend on the batch's adapters, so decode graphs capture it.

Under tensor parallelism the slots are split as the layer's weight is: a column-parallel layer keeps its
outputs' rows of ``B`` (``A`` whole), a row-parallel one its inputs' columns of ``A`` (``B`` whole). The
row-parallel update is then a partial sum like the layer's own, and the layer's all-reduce adds it up.
"""

from __future__ import annotations

import torch
from torch import nn

from dovetail.lora.adapter import LoRAWeights
from dovetail.lora.context import slot_mask
from dovetail.ops import FusedOps


class LinearLoRA(nn.Module):
    """``max_loras`` adapter slots of rank up to ``max_rank`` for ``linear`` (a
    :class:`~dovetail.layers.linear.Linear`), each merged output part (QKV, gate/up) with its own ``A`` and its
    own columns of ``B``."""

    def __init__(self, linear: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | None = None):
        super().__init__()
        self.num_parts, self.num_slots, self.max_rank = len(linear.output_sizes), max_loras, max_rank
        #: The platform's fused ops, whose ``lora_expand`` does the masked expand step.
        self.ops = linear.ops or FusedOps()
        self.output_sizes = list(linear.output_sizes)
        self.offsets = [sum(self.output_sizes[:p]) for p in range(self.num_parts)]
        width = max_loras * max_rank
        self.register_buffer("a", torch.zeros(self.num_parts * width, linear.input_size, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("b", torch.zeros(width, linear.output_size, dtype=dtype, device=device),
                             persistent=False)

    def clear(self, slot: int) -> None:
        """Empty ``slot``: its tokens get no update from this layer."""
        rows = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        for part in range(self.num_parts):
            self.a[part * self.num_slots * self.max_rank:][rows].zero_()
        self.b[rows].zero_()

    def load(self, slot: int, part: int, weights: LoRAWeights) -> None:
        """Put one merged part's update (this rank's share of it) in ``slot``; the scale goes into ``B``."""
        rank = weights.rank
        start = (part * self.num_slots + slot) * self.max_rank
        self.a[start:start + rank].copy_(weights.a)
        columns = slice(self.offsets[part], self.offsets[part] + self.output_sizes[part])
        self.b[slot * self.max_rank:slot * self.max_rank + rank, columns].copy_((weights.b * weights.scale).t())

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the layer's output for ``x``) plus each token's adapter update, in place."""
        shrunk = torch.nn.functional.linear(x, self.a)
        return self.ops.lora_expand(shrunk, slot_mask(), self.b, out, self.output_sizes, self.max_rank)

    def extra_repr(self) -> str:
        return f"slots={self.num_slots}, max_rank={self.max_rank}, parts={self.num_parts}"
