"""Quantize, dequantize, pack and unpack: the math the quantization methods share.

Conventions:

- FP8 is ``float8_e4m3fn`` (largest finite value 448); INT8 is symmetric in ``[-127, 127]``.
- A scale multiplies the quantized value back: ``real = q * scale`` (``(q - zero) * scale``
  for the asymmetric 4/8-bit formats).
- Weights are ``[out_features, in_features]`` unless said otherwise; activations are
  ``[tokens, in_features]``.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
INT8_MAX = 127.0
#: Smallest scale used for an all-zero row, so that dividing by it stays finite.
MIN_SCALE = 1e-12
#: AutoAWQ's GEMM packing: nibble ``i`` of a word holds column ``AWQ_PACK_ORDER[i]`` of its 8.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def fp8_dtype() -> torch.dtype:
    return torch.float8_e4m3fn


def fp8_missing_reason() -> str | None:
    """Why this torch cannot hold FP8 tensors, or None when it can."""
    if not hasattr(torch, "float8_e4m3fn"):
        return f"torch {torch.__version__} has no float8_e4m3fn dtype (torch 2.1 or later has it)"
    return None


# -- FP8 ----------------------------------------------------------------------------------


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[N, K]`` as FP8 with one float32 scale per output row (``[N]``)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(fp8_dtype())
    return q, scale


def quantize_fp8_per_token(x: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization of activations ``[M, K]``.

    One float32 scale per token (``[M, 1]``), or per token and group of
    ``group_size`` consecutive features (``[M, ceil(K / group_size)]``).
    """
    if group_size is None:
        scale = (_row_amax(x) / FP8_MAX).clamp_(min=MIN_SCALE)
        # |x / scale| <= 448 up to float32 rounding, which FP8's round-to-nearest brings back to 448:
        # one kernel divides and converts.
        q = torch.empty(x.shape, dtype=fp8_dtype(), device=x.device)
        return torch.div(x, scale, out=q), scale
    groups = _split_groups(x.float(), group_size)
    scale = (groups.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX)
    return q.flatten(-2)[..., : x.shape[-1]].to(fp8_dtype()), scale


def _row_amax(x: torch.Tensor) -> torch.Tensor:
    """float32 ``max |x|`` of each row, ``[M, 1]``, in one reduction (few launches matter at batch 1)."""
    return torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)


def quantize_fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 quantization of activations with a fixed per-tensor ``scale``."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(fp8_dtype())


def dequantize_fp8_weight(weight: torch.Tensor, scale: torch.Tensor,
                          block_size: tuple[int, int] | None = None) -> torch.Tensor:
    """Float32 ``[N, K]`` from an FP8 weight and its per-row ``[N]`` or block ``[ceil(N/bn), ceil(K/bk)]`` scales."""
    w = weight.float()
    if block_size is None:
        return w * scale.float().reshape(-1, 1)
    bn, bk = block_size
    n, k = w.shape
    expanded = scale.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return w * expanded


def dequantize_per_group(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """Float32 ``[M, K]`` from activations quantized per token and group (``scale`` ``[M, ceil(K/g)]``)."""
    expanded = scale.float().repeat_interleave(group_size, dim=-1)[..., : q.shape[-1]]
    return q.float() * expanded


def _split_groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    k = x.shape[-1]
    pad = (-k) % group_size
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.unflatten(-1, (-1, group_size))


# -- INT8 ----------------------------------------------------------------------------------


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[N, K]`` as symmetric INT8 with one float32 scale per output row (``[N]``)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / INT8_MAX).clamp(min=MIN_SCALE)
    q = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric INT8 quantization of activations ``[M, K]``; scales ``[M, 1]`` float32."""
    scale = (_row_amax(x) / INT8_MAX).clamp_(min=MIN_SCALE)
    return torch.round(x / scale).to(torch.int8), scale  # |x / scale| <= 127 up to rounding


def quantize_int8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Symmetric INT8 quantization of activations with a fixed per-tensor ``scale``."""
    return torch.round(x.float() / scale.float()).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


# -- packed 4- and 8-bit integers -------------------------------------------------------------


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned ``bits``-bit values packed in int32 words along ``dim`` (low bits first).

    ``order[i]`` names the position, among the word's values, held by bit field ``i``
    (``None``: field ``i`` holds value ``i``). Returns int32 with ``dim`` grown by ``32 // bits``.
    """
    per_word = 32 // bits
    dim = dim % packed.dim()
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    fields = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., per_word] in field order
    if order is not None:
        position_to_field = sorted(range(per_word), key=lambda field: order[field])
        fields = fields[..., position_to_field]
    fields = fields.movedim(-1, dim + 1)
    return fields.flatten(dim, dim + 1)


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`unpack_int32` with the natural order: ``32 // bits`` values per int32 along ``dim``."""
    per_word = 32 // bits
    dim = dim % values.dim()
    if values.shape[dim] % per_word:
        raise ValueError(f"cannot pack {values.shape[dim]} values in words of {per_word}")
    grouped = values.to(torch.int64).unflatten(dim, (-1, per_word)).movedim(dim + 1, -1)
    shifts = torch.arange(0, 32, bits, device=values.device, dtype=torch.int64)
    words = (grouped << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def dequantize_wna16(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
                     bits: int) -> torch.Tensor:
    """Float32 ``[K, N]`` weights from the canonical packed layout of :meth:`QuantKernels.wna16_linear`."""
    q = unpack_int32(qweight, bits, dim=0).float()
    rows = g_idx.long()
    return (q - zeros.float()[rows]) * scales.float()[rows]
