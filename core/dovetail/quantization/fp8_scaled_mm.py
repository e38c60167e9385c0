"""FP8 linear through ``torch._scaled_mm`` (row-wise scales), for platforms with FP8 matmuls.

Pure torch, no vendor import: a platform whose device multiplies FP8 natively
(NVIDIA sm89+/Hopper) returns :class:`ScaledMMQuantKernels` (or a subclass) from
``Platform.quant_kernels()``. Shapes the kernel does not take (K or N not a
multiple of 16, block scales) fall back to the reference definition.
"""

from __future__ import annotations

import torch

from dovetail.quantization import quant_ops
from dovetail.quantization.kernels import QuantKernels, _finish


def scaled_mm_supported(weight: torch.Tensor, block_size: tuple[int, int] | None) -> bool:
    """Whether :func:`fp8_linear_scaled_mm` takes this ``[N, K]`` FP8 weight."""
    n, k = weight.shape
    return block_size is None and weight.dtype == quant_ops.fp8_dtype() and n % 16 == 0 and k % 16 == 0


def fp8_linear_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None = None, *, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """:meth:`QuantKernels.fp8_linear` (per-channel weight scales) as one ``torch._scaled_mm``.

    Activations are quantized per token (or with the static ``input_scale``) and
    multiplied with row-wise scaling: ``scale_a`` ``[M, 1]``, ``scale_b`` ``[1, N]``,
    float32 accumulation, bfloat16 output (the only one row-wise scaling gives on
    every device), converted to ``x``'s dtype.
    """
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    if input_scale is None:
        xq, x_scale = quant_ops.quantize_fp8_per_token(x2)
    else:
        xq = quant_ops.quantize_fp8_static(x2, input_scale)
        x_scale = input_scale.float().reshape(1, 1).expand(m, 1).contiguous()
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.float().reshape(1, -1),
                           out_dtype=torch.bfloat16)
    return _finish(out, bias, x)


class ScaledMMQuantKernels(QuantKernels):
    """:class:`QuantKernels` with FP8 linears on ``torch._scaled_mm`` where the shapes allow."""

    name = "torch-scaled-mm"

    def fp8_linear(self, x, weight, weight_scale, bias=None, *, input_scale=None, block_size=None):
        if scaled_mm_supported(weight, block_size):
            return fp8_linear_scaled_mm(x, weight, weight_scale, bias, input_scale=input_scale)
        return super().fp8_linear(x, weight, weight_scale, bias, input_scale=input_scale, block_size=block_size)
