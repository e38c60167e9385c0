"""Quantization kernels for GPUs, ready for a platform's ``quant_kernels()`` to return.

- FP8: ``torch._scaled_mm`` with row-wise scales (:mod:`dovetail.quantization.fp8_scaled_mm`).
- INT8: ``torch._int_mm`` (the reference definition already uses it on CUDA devices).
- GPTQ / AWQ: the Triton dequantise-and-multiply kernel :mod:`dovetail.triton.quant_wna16`.

Importing this module imports neither triton nor a device runtime; the Triton
kernel is imported on first use.
"""

from __future__ import annotations

from dovetail.quantization.fp8_scaled_mm import ScaledMMQuantKernels


class GpuQuantKernels(ScaledMMQuantKernels):
    """FP8 on ``torch._scaled_mm``, INT8 on ``torch._int_mm``, packed 4/8-bit weights on Triton."""

    name = "gpu"

    def __init__(self):
        self._wna16 = None

    def wna16_linear(self, x, qweight, scales, zeros, g_idx, bits, bias=None):
        if self._wna16 is None:
            from dovetail.triton.quant_wna16 import wna16_linear_triton

            self._wna16 = wna16_linear_triton
        return self._wna16(x, qweight, scales, zeros, g_idx, bits, bias)
