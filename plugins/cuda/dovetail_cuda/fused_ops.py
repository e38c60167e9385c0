"""CudaFusedOps: the core's Triton fused ops, with decode-sized 16-bit linears on tuned cuBLASLt algorithms."""

from __future__ import annotations

import torch

from dovetail.triton.fused_ops import TritonFusedOps
from dovetail_cuda import lt_linear


class CudaFusedOps(TritonFusedOps):
    """:class:`TritonFusedOps` whose 16-bit linears of decode graph sizes (``lt_linear.TUNED_ROWS``) run the
    cuBLASLt algorithm timed fastest for their shape (:mod:`dovetail_cuda.lt_linear`); one-token linears keep the Triton
    GEMV, and everything else ``F.linear``."""

    name = "triton"

    def __init__(self):
        self.tuned_linear = lt_linear.TunedLinear()

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if lt_linear.applies(x, weight, bias):
            out = self.tuned_linear(x, weight)
            if out is not None:
                return out
        return super().linear(x, weight, bias)
