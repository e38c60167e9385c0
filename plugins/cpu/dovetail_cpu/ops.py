"""The CPU platform's fused operations: C++ SIMD kernels where they beat torch, torch elsewhere.

Each override was measured against :class:`dovetail.ops.FusedOps` with ``benchmarks/kernels_cpu.py``
(figures in benchmarks/RESULTS.md). Inputs the kernels do not take (other dtypes, strided
inner dimensions, a weight of another dtype) go to the torch definition.
"""

from __future__ import annotations

import torch

from dovetail.ops import FusedOps
from dovetail_cpu import _native, kernels

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class CpuFusedOps(FusedOps):
    """RMSNorm (with the residual add), NeoX rotary embedding, SiLU-and-mul and decode-sized linear in C++."""

    name = "cpu_simd"

    def rms_norm(self, x, weight, eps):
        if x.dtype in _KERNEL_DTYPES and weight.dtype in (torch.float32, x.dtype) and x.stride(-1) == 1:
            return kernels.rms_norm(x, weight, eps, torch.get_num_threads())
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if (x.dtype in _KERNEL_DTYPES and residual.dtype == x.dtype and weight.dtype in (torch.float32, x.dtype)
                and x.stride(-1) == 1 and residual.stride(-1) == 1):
            return kernels.add_rms_norm(x, residual, weight, eps, torch.get_num_threads())
        return super().add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x):
        if x.dtype in _KERNEL_DTYPES and x.stride(-1) == 1:
            return kernels.silu_and_mul(x, torch.get_num_threads())
        return super().silu_and_mul(x)

    def rotary_embedding(self, positions, q, k, cos_sin_cache, head_size, rotary_dim):
        if (q.dtype in _KERNEL_DTYPES and k.dtype == q.dtype and q.dim() == 2 and k.dim() == 2
                and positions.dtype == torch.int64 and cos_sin_cache.dtype == torch.float32):
            return kernels.rotary_embedding(positions, q, k, cos_sin_cache, head_size, rotary_dim,
                                            torch.get_num_threads())
        return super().rotary_embedding(positions, q, k, cos_sin_cache, head_size, rotary_dim)

    #: Rows (tokens) up to which the C++ register-tiled kernel beats torch's GEMM, by (ISA, weight dtype, wide):
    #: wide is a vocabulary-sized output (n >= 16384). Measured on Zen 4 with 2 threads (benchmarks/kernels_cpu.py
    #: --skip-ops --skip-attention); in bfloat16 torch uses the CPU's BF16 dot-product instructions and wins beyond a few rows.
    LINEAR_MAX_ROWS = {
        ("avx512", torch.float32, False): 64, ("avx512", torch.float32, True): 256,
        ("avx2", torch.float32, False): 16, ("avx2", torch.float32, True): 64,
    }
    LINEAR_MAX_ROWS_DEFAULT = 4

    def linear(self, x, weight, bias=None):
        """``F.linear(x, weight, bias)``, through the C++ kernel up to the measured batch sizes, torch's GEMM above."""
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        key = (self._isa_family(), weight.dtype, weight.shape[0] >= 16384)
        limit = self.LINEAR_MAX_ROWS.get(key, self.LINEAR_MAX_ROWS_DEFAULT)
        if (0 < rows <= limit and x.dtype in _KERNEL_DTYPES and weight.dtype in (torch.float32, x.dtype)
                and weight.is_contiguous() and x.stride(-1) == 1 and (bias is None or bias.dtype == x.dtype)):
            return kernels.linear(x, weight, bias, torch.get_num_threads())
        return super().linear(x, weight, bias)

    @staticmethod
    def _isa_family() -> str:
        isa = _native.current_isa()
        return "avx512" if isa.startswith("avx512") else isa
