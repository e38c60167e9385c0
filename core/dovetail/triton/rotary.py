"""Rotary position embedding (NeoX style) of ``q`` and ``k`` together, one token per program.

``cos_sin_cache`` is ``[max_position, rotary_dim]``: cosines in the first half,
sines in the second (as :mod:`dovetail.layers.rotary` builds it). Features past
``rotary_dim`` are copied unchanged.

With ``NORM`` each head is first RMS-normalised with its own weight (q's or k's: Qwen 3's and
Gemma 3's per-head q/k norms), in the same launch, rounded where the torch definition rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dovetail.triton import next_power_of_2, unaligned
from dovetail.triton.pdl import launch_kwargs, pdl_prologue, use_pdl


@triton.jit
def normalised(x, rstd, weight, WEIGHT_FP32: tl.constexpr, dtype: tl.constexpr):
    """``x * rstd * weight`` in float32, rounded where the torch RMSNorm definition rounds: once with float32
    weights, before and after the weight with weights in the activations' ``dtype``."""
    if WEIGHT_FP32:
        y = (x * rstd * weight).to(dtype).to(tl.float32)
    else:
        y = ((x * rstd).to(dtype).to(tl.float32) * weight).to(dtype).to(tl.float32)
    return y


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, cos, sin, norm_weight_ptr, eps, NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                  HEAD_SIZE: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, NORM: tl.constexpr,
                  WEIGHT_FP32: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    cols = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (cols < HALF)
    offset = heads * HEAD_SIZE + cols
    x1 = tl.load(src_ptr + offset, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + offset + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = dst_ptr.dtype.element_ty
    if NORM:  # the whole head is rotated here (rotary_dim == head_size), so both halves hold all of it
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_SIZE + eps)[:, None]
        w1 = tl.load(norm_weight_ptr + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(norm_weight_ptr + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        x1 = normalised(x1, rstd, w1, WEIGHT_FP32, dtype)
        x2 = normalised(x2, rstd, w2, WEIGHT_FP32, dtype)
    tl.store(dst_ptr + offset, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(dst_ptr + offset + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit(**unaligned("positions_ptr", "slot_ptr"))
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr,
    v_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    stride_q, stride_k, stride_q_out, stride_k_out, stride_cos_sin, eps,
    stride_v, stride_cache_block, stride_cache_slot,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, NORM: tl.constexpr,
    WEIGHT_FP32: tl.constexpr, CACHE_WRITE: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, HALF_PAD)[None, :]
    row = cos_sin_ptr + position * stride_cos_sin
    # Rounded to the activations' dtype first, as the torch definition does.
    dtype = q_out_ptr.dtype.element_ty
    cos = tl.load(row + cols, mask=cols < HALF, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(row + HALF + cols, mask=cols < HALF, other=0.0).to(dtype).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_q, q_out_ptr + token * stride_q_out, cos, sin, q_norm_ptr, eps,
                  NUM_HEADS, HEADS_PAD, HEAD_SIZE, HALF, HALF_PAD, NORM, WEIGHT_FP32)
    if CACHE_WRITE:  # the rotated key and the value go straight to the token's slot (none when negative)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:
            at = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot
            _rotate_heads(k_ptr + token * stride_k, key_cache_ptr + at, cos, sin, k_norm_ptr, eps,
                          NUM_KV_HEADS, KV_HEADS_PAD, HEAD_SIZE, HALF, HALF_PAD, NORM, WEIGHT_FP32)
            heads = tl.arange(0, KV_HEADS_PAD)[:, None]
            dims = tl.arange(0, HEAD_PAD)[None, :]
            mask = (heads < NUM_KV_HEADS) & (dims < HEAD_SIZE)
            value = tl.load(v_ptr + token * stride_v + heads * HEAD_SIZE + dims, mask=mask)
            tl.store(value_cache_ptr + at + heads * HEAD_SIZE + dims,
                     value.to(value_cache_ptr.dtype.element_ty), mask=mask)
    else:
        _rotate_heads(k_ptr + token * stride_k, k_out_ptr + token * stride_k_out, cos, sin, k_norm_ptr, eps,
                      NUM_KV_HEADS, KV_HEADS_PAD, HEAD_SIZE, HALF, HALF_PAD, NORM, WEIGHT_FP32)


def supports(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
             head_size: int, rotary_dim: int) -> bool:
    """Whether the kernel covers these inputs (else the caller uses the torch definition)."""
    return (q.dim() == 2 and k.dim() == 2 and q.shape[0] > 0 and q.shape[0] == k.shape[0] == positions.numel()
            and q.dtype == k.dtype and q.shape[1] % head_size == 0 and k.shape[1] % head_size == 0
            and rotary_dim % 2 == 0 and 0 < rotary_dim <= head_size and cos_sin_cache.shape[-1] == rotary_dim
            and cos_sin_cache.stride(-1) == 1 and q.stride(-1) == 1 and k.stride(-1) == 1)


def supports_qk_norm(q_weight: torch.Tensor, k_weight: torch.Tensor, q: torch.Tensor, head_size: int,
                     rotary_dim: int) -> bool:
    """Whether the kernel can also apply per-head q/k RMSNorm with these weights (else: norms, then rotary)."""
    return (rotary_dim == head_size and q_weight.shape == k_weight.shape == (head_size,)
            and q_weight.dtype == k_weight.dtype and q_weight.dtype in (torch.float32, q.dtype)
            and q_weight.is_contiguous() and k_weight.is_contiguous())


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                     head_size: int, rotary_dim: int, q_norm_weight: torch.Tensor | None = None,
                     k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6):
    """Return ``(q, k)`` rotated at ``positions``; ``q``, ``k`` are ``[tokens, heads * head_size]``.

    With ``q_norm_weight`` and ``k_norm_weight`` (see :func:`supports_qk_norm`), each head is
    RMS-normalised first, as ``FusedOps.qk_norm_rotary_embedding`` defines.
    """
    partial = rotary_dim < head_size
    q_out = q.clone(memory_format=torch.contiguous_format) if partial else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = k.clone(memory_format=torch.contiguous_format) if partial else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch(positions, q, k, q_out, k_out, cos_sin_cache, head_size, rotary_dim, q_norm_weight, k_norm_weight, eps)
    return q_out, k_out


def writes_cache(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 head_size: int, rotary_dim: int) -> bool:
    """Whether :func:`rotary_embedding_into_cache` covers these: whole heads rotated, ``v`` shaped as ``k``
    (``[tokens, kv_heads * head_size]``), and caches ``[blocks, block_size, kv_heads, head_size]`` of one
    layout whose heads are contiguous rows, in ``k``'s dtype (an FP8 cache needs its scales:
    :func:`dovetail.triton.kv_cache_write.write_kv_cache`)."""
    return (rotary_dim == head_size and v.shape == k.shape and v.dtype == k.dtype and v.dim() == 2
            and key_cache.dtype == k.dtype and value_cache.dtype == k.dtype
            and v.stride(-1) == 1 and key_cache.dim() == 4
            and tuple(key_cache.shape[2:]) == (k.shape[1] // head_size, head_size)
            and key_cache.stride() == value_cache.stride() and key_cache.stride(-1) == 1
            and key_cache.stride(-2) == head_size)


def rotary_embedding_into_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                                cos_sin_cache: torch.Tensor, head_size: int, q_norm_weight: torch.Tensor | None = None,
                                k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Rotate ``q`` (returned) and ``k`` as :func:`rotary_embedding` does, storing the rotated ``k`` and ``v``
    (``[tokens, kv_heads * head_size]``) in the caches at ``slot_mapping`` (a negative slot stores nothing)
    instead of returning ``k``: one launch for the rotation and the KV-cache write. See :func:`writes_cache`."""
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch(positions, q, k, q_out, q_out, cos_sin_cache, head_size, head_size, q_norm_weight, k_norm_weight, eps,
            cache_write=(v, key_cache, value_cache, slot_mapping))
    return q_out


def _launch(positions, q, k, q_out, k_out, cos_sin_cache, head_size, rotary_dim, q_norm_weight, k_norm_weight, eps,
            cache_write=None):
    norm = q_norm_weight is not None
    num_heads, num_kv_heads = q.shape[1] // head_size, k.shape[1] // head_size
    half = rotary_dim // 2
    heads_pad = next_power_of_2(num_heads)
    v, key_cache, value_cache, slots = cache_write if cache_write is not None else (k, k, k, positions)
    _rotary_kernel[(q.shape[0],)](
        positions, q, k, q_out, k_out, cos_sin_cache, q_norm_weight if norm else q, k_norm_weight if norm else k,
        v, key_cache, value_cache, slots,
        q.stride(0), k.stride(0), q_out.stride(0), k_out.stride(0), cos_sin_cache.stride(0), float(eps),
        v.stride(0), key_cache.stride(0) if cache_write is not None else 0,
        key_cache.stride(1) if cache_write is not None else 0,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEADS_PAD=heads_pad,
        KV_HEADS_PAD=next_power_of_2(num_kv_heads), HEAD_SIZE=head_size, HALF=half,
        HALF_PAD=next_power_of_2(half), NORM=norm, WEIGHT_FP32=norm and q_norm_weight.dtype == torch.float32,
        CACHE_WRITE=cache_write is not None, BLOCK_SIZE=key_cache.shape[1] if cache_write is not None else 1,
        HEAD_PAD=next_power_of_2(head_size),
        num_warps=4 if heads_pad * next_power_of_2(half) >= 1024 else 1, **launch_kwargs(use_pdl(q.device)),
    )
