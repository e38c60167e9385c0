"""Quantization kernels for GPUs, ready for a platform's ``quant_kernels()`` to return.

- FP8, per-channel scales: up to :data:`FP8_GEMV_MAX_M` tokens, the weight-only Triton GEMV
  :mod:`dovetail.triton.gemv` (activations are not quantized); more tokens, ``torch._scaled_mm``
  with row-wise scales (:mod:`dovetail.quantization.fp8_scaled_mm`).
- INT8: ``torch._int_mm`` (the reference definition already uses it on CUDA devices).
- GPTQ / AWQ: the Triton dequantise-and-multiply kernel :mod:`dovetail.triton.quant_wna16`.

Importing this module imports neither triton nor a device runtime; the Triton
kernels are imported on first use.
"""

from __future__ import annotations

import torch

from dovetail.quantization import quant_ops
from dovetail.quantization.fp8_scaled_mm import ScaledMMQuantKernels
from dovetail.triton import triton_missing_reason

#: Most tokens (rows of the flattened activations) for which an FP8 linear runs :func:`fp8_gemv
#: <dovetail.triton.gemv.fp8_gemv>` rather than ``torch._scaled_mm`` (benchmarks/kernels_linear.py compares them).
FP8_GEMV_MAX_M = 16


def use_fp8_gemv(m: int, weight: torch.Tensor, weight_scale: torch.Tensor,
                 block_size: tuple[int, int] | None) -> bool:
    """Whether :class:`GpuQuantKernels` runs an FP8 linear of ``m`` tokens on the weight-only GEMV."""
    return (m <= FP8_GEMV_MAX_M and block_size is None and weight.dim() == 2
            and weight.dtype == quant_ops.fp8_dtype() and weight_scale.numel() == weight.shape[0]
            and triton_missing_reason() is None)


class GpuQuantKernels(ScaledMMQuantKernels):
    """FP8 on a Triton GEMV (few tokens) or ``torch._scaled_mm``, INT8 on ``torch._int_mm``, 4/8-bit on Triton."""

    name = "gpu"

    def __init__(self):
        self._wna16 = None
        self._fp8_gemv = None

    def fp8_linear(self, x, weight, weight_scale, bias=None, *, input_scale=None, block_size=None):
        """:meth:`QuantKernels.fp8_linear`, but weight-only (W8A16) up to :data:`FP8_GEMV_MAX_M` tokens.

        There the activations are not quantized, which is closer to the float product than W8A8, and
        a static ``input_scale`` is ignored. Output dtype and bias are as on the other paths.
        """
        if use_fp8_gemv(x.numel() // max(1, x.shape[-1]), weight, weight_scale, block_size):
            if self._fp8_gemv is None:
                from dovetail.triton.gemv import fp8_gemv

                self._fp8_gemv = fp8_gemv
            return self._fp8_gemv(x, weight, weight_scale, bias)
        return super().fp8_linear(x, weight, weight_scale, bias, input_scale=input_scale, block_size=block_size)

    def wna16_linear(self, x, qweight, scales, zeros, g_idx, bits, bias=None):
        if self._wna16 is None:
            from dovetail.triton.quant_wna16 import wna16_linear_triton

            self._wna16 = wna16_linear_triton
        return self._wna16(x, qweight, scales, zeros, g_idx, bits, bias)
