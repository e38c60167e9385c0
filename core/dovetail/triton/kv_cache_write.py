"""The KV-cache write: store each new token's keys and values at its slot.

The cache is ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (keys,
then values); slot ``s`` is row ``s % block_size`` of block ``s // block_size``.
A negative slot means "do not write" (padding). One program stores one token's
keys and values for every KV head. An FP8 cache stores them divided by the layer's
``k_scale`` / ``v_scale`` (:mod:`dovetail.triton.kv_quant`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dovetail.triton import interpreter_active, next_power_of_2, unaligned
from dovetail.triton.kv_quant import to_cache
from dovetail.triton.pdl import launch_kwargs, pdl_prologue, use_pdl


@triton.jit(**unaligned("slot_ptr"))
def _kv_cache_write_kernel(
    k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr, KV_FP8: tl.constexpr, ROUND_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_SIZE)
    block = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE
    cache_offset = (block * stride_cache_block + row * stride_cache_slot
                    + heads[:, None] * stride_cache_head + dims[None, :])
    key = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    value = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(key_cache_ptr + cache_offset, to_cache(key, k_scale, key_cache_ptr.dtype.element_ty, KV_FP8, ROUND_FP8),
             mask=mask)
    tl.store(value_cache_ptr + cache_offset,
             to_cache(value, v_scale, value_cache_ptr.dtype.element_ty, KV_FP8, ROUND_FP8), mask=mask)


def is_fp8(cache: torch.Tensor) -> bool:
    """Whether ``cache`` is an FP8 (e4m3) cache, whose values are stored scaled."""
    return cache.dtype == torch.float8_e4m3fn


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store ``k``, ``v`` (``[tokens, kv_heads, head_size]``) into ``kv_cache`` at ``slot_mapping``.

    Rows of ``slot_mapping`` past ``k``'s tokens are ignored; a negative slot skips its token. An FP8 cache
    stores ``k / k_scale`` and ``v / v_scale`` (:mod:`dovetail.triton.kv_quant`); other caches ignore the scales.
    """
    num_tokens = min(k.shape[0], slot_mapping.shape[0])
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    if k.shape[1:] != (num_kv_heads, head_size) or v.shape[1:] != (num_kv_heads, head_size):
        raise ValueError(f"k and v must be [tokens, {num_kv_heads}, {head_size}] to match the KV cache "
                         f"(got k {tuple(k.shape)}, v {tuple(v.shape)})")
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    if key_cache.stride(-1) != 1 or key_cache.stride() != value_cache.stride():
        raise ValueError("kv_cache must be contiguous in its last dimension, keys and values alike")
    _kv_cache_write_kernel[(num_tokens,)](
        k, v, key_cache, value_cache, slot_mapping, float(k_scale), float(v_scale),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, BLOCK_SIZE=block_size,
        HEADS_PAD=next_power_of_2(num_kv_heads), HEAD_PAD=next_power_of_2(head_size),
        KV_FP8=is_fp8(key_cache), ROUND_FP8=is_fp8(key_cache) and interpreter_active(),
        num_warps=4 if num_kv_heads * head_size >= 1024 else 1, **launch_kwargs(use_pdl(k.device)),
    )
