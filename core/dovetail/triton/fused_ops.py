"""TritonFusedOps: the fused operations of :mod:`dovetail.ops` as Triton kernels.

A GPU platform returns ``TritonFusedOps()`` from ``Platform.fused_ops()``. Each
operation equals the torch definition it overrides (within the dtype's
rounding); inputs a kernel does not cover (empty tensors, unusual dtype mixes)
go to that definition.
"""

from __future__ import annotations

import torch

from dovetail.ops import FusedOps
from dovetail.triton import activation, norm, rotary


class TritonFusedOps(FusedOps):
    """RMSNorm (with the residual add), NeoX rotary, SiLU-and-mul and GELU-tanh-and-mul in Triton."""

    name = "triton"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not norm.supports(x, weight):
            return super().rms_norm(x, weight, eps)
        return norm.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        if not norm.supports(x, weight) or residual.shape != x.shape or residual.dtype != x.dtype:
            return super().add_rms_norm(x, residual, weight, eps)
        return norm.rms_norm(x, weight, eps, residual=residual)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return super().silu_and_mul(x)
        return activation.act_and_mul(x, gelu_tanh=False)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return super().gelu_tanh_and_mul(x)
        return activation.act_and_mul(x, gelu_tanh=True)

    def rotary_embedding(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         cos_sin_cache: torch.Tensor, head_size: int, rotary_dim: int):
        if not rotary.supports(positions, q, k, cos_sin_cache, head_size, rotary_dim):
            return super().rotary_embedding(positions, q, k, cos_sin_cache, head_size, rotary_dim)
        return rotary.rotary_embedding(positions, q, k, cos_sin_cache, head_size, rotary_dim)
