"""Kernels that quantization methods call, in plain torch; platforms override them.

A quantization method defines a checkpoint format and its math; the fast
kernels belong to the hardware. :meth:`dovetail.platform.Platform.quant_kernels`
returns a subclass of :class:`QuantKernels` whose overrides must match these
definitions (the conformance kit checks a method's round trip on them).

Every kernel takes activations ``x`` of shape ``[..., K]`` in the model's dtype
and returns ``[..., N]`` in that dtype. The definitions here compute in float32.
Ready-made overrides: :mod:`dovetail.quantization.fp8_scaled_mm` (``torch._scaled_mm``)
and :class:`dovetail.quantization.gpu_kernels.GpuQuantKernels` (that, plus Triton
for the packed 4/8-bit weights).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dovetail.quantization import quant_ops


class QuantKernels:
    """Reference (plain torch) kernels used by the quantization methods."""

    name = "torch"

    def fp8_linear(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None, *, input_scale: torch.Tensor | None = None,
                   block_size: tuple[int, int] | None = None) -> torch.Tensor:
        """``fp8(x) @ (weight * weight_scale).T + bias`` (W8A8 FP8).

        - ``weight``: ``[N, K]`` float8_e4m3fn.
        - ``weight_scale``: float32, ``[N]`` (per output channel) or, with
          ``block_size = (bn, bk)``, ``[ceil(N / bn), ceil(K / bk)]`` (per block).
        - ``input_scale``: a float32 per-tensor scale for static activations; None
          quantizes each token dynamically (per token, and per group of ``bk``
          features with ``block_size``).
        """
        x2 = x.reshape(-1, x.shape[-1])
        if input_scale is not None:
            xd = quant_ops.quantize_fp8_static(x2, input_scale).float() * input_scale.float()
        elif block_size is not None:
            xq, scale = quant_ops.quantize_fp8_per_token(x2, block_size[1])
            xd = quant_ops.dequantize_per_group(xq, scale, block_size[1])
        else:
            xq, scale = quant_ops.quantize_fp8_per_token(x2)
            xd = xq.float() * scale
        out = F.linear(xd, quant_ops.dequantize_fp8_weight(weight, weight_scale, block_size))
        return _finish(out, bias, x)

    def fp8_linear_gated(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None, activation: str, *, input_scale: torch.Tensor | None = None,
                         block_size: tuple[int, int] | None = None) -> torch.Tensor | None:
        """``act(y[..., :N/2]) * y[..., N/2:]`` for ``y`` = :meth:`fp8_linear` (a merged gate/up projection)
        in one kernel, or None where there is none for these operands (the caller then runs :meth:`fp8_linear`
        and the activation). ``activation`` is a :mod:`dovetail.layers.activation` name (``"silu"``, ...).

        An override computes the activation from the product before rounding it to x's dtype, so it
        may differ from the two-step result by that rounding. The definition here has no fused kernel.
        """
        return None

    def int8_linear(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, *, input_scale: torch.Tensor | None = None) -> torch.Tensor:
        """``int8(x) @ (weight * weight_scale).T + bias`` (W8A8 INT8, symmetric).

        - ``weight``: ``[N, K]`` int8; ``weight_scale``: ``[N]`` float32.
        - ``input_scale``: a float32 per-tensor scale for static activations; None
          quantizes each token dynamically.

        The product accumulates in int32 (:meth:`int8_matmul`).
        """
        x2 = x.reshape(-1, x.shape[-1])
        if input_scale is not None:
            xq, x_scale = quant_ops.quantize_int8_static(x2, input_scale), input_scale.float().reshape(1, 1)
        else:
            xq, x_scale = quant_ops.quantize_int8_per_token(x2)
        acc = self.int8_matmul(xq, weight)
        out = acc.float() * x_scale * weight_scale.float().reshape(1, -1)
        return _finish(out, bias, x)

    def int8_matmul(self, xq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Exact int32 ``xq @ weight.T`` for int8 ``xq`` ``[M, K]`` and ``weight`` ``[N, K]`` (:func:`int8_matmul`)."""
        return int8_matmul(xq, weight)

    def wna16_linear(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     g_idx: torch.Tensor, bits: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W + bias`` with ``W[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]``, ``g = g_idx[k]``.

        The packed layout GPTQ and AWQ checkpoints are converted to at load:

        - ``qweight``: int32 ``[K * bits / 32, N]``; value ``q[k, n]`` is bits
          ``(k % p) * bits ...`` of word ``[k // p, n]``, ``p = 32 // bits``.
        - ``scales``, ``zeros``: float32 ``[groups, N]`` (zeros are the true zero points).
        - ``g_idx``: int32 ``[K]``, the group of each input feature (act-order
          checkpoints permute it).
        - ``bits``: 4 or 8.
        """
        w = quant_ops.dequantize_wna16(qweight, scales, zeros, g_idx, bits)
        out = x.reshape(-1, x.shape[-1]).float() @ w
        return _finish(out, bias, x)


def int8_matmul(xq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Exact int32 ``xq @ weight.T`` for int8 ``xq`` ``[M, K]`` and ``weight`` ``[N, K]``.

    ``torch._int_mm`` on CUDA (whose kernel needs more than 16 rows and K, N
    multiples of 8: rows are padded); float32 products elsewhere
    (:func:`int8_matmul_in_float32`). Not ``torch._int_mm`` on the CPU: there it
    goes through oneDNN, whose kernels for CPUs without int8 dot products (VNNI),
    such as AVX2-only ones, saturate 16-bit partial sums; a CPU platform that
    knows its CPU has them overrides :meth:`QuantKernels.int8_matmul`.
    """
    m, k = xq.shape
    n = weight.shape[0]
    if xq.device.type == "cuda" and k % 8 == 0 and n % 8 == 0:
        if m <= 16:
            padded = xq.new_zeros(17, k)
            padded[:m] = xq
            return torch._int_mm(padded, weight.t())[:m]
        return torch._int_mm(xq, weight.t())
    return int8_matmul_in_float32(xq, weight)


#: Products of int8 values are at most 2**14 in size, so 1,024 of them sum within float32's exact integers (2**24).
_EXACT_FLOAT32_CHUNK = 1024


def int8_matmul_in_float32(xq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Exact int32 ``xq @ weight.T`` through float32 matrix products over chunks of K of at most 1,024."""
    k = xq.shape[1]
    acc = None
    for start in range(0, k, _EXACT_FLOAT32_CHUNK):
        end = min(start + _EXACT_FLOAT32_CHUNK, k)
        part = (xq[:, start:end].float() @ weight[:, start:end].float().t()).to(torch.int32)
        acc = part if acc is None else acc.add_(part)
    return acc


def _finish(out: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])
