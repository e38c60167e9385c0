"""One paged-attention kernel for prefill, chunked prefill and decode.

The grid is ``(query blocks, KV heads[, KV splits])``. A program takes up to
``BLOCK_Q`` consecutive query tokens of one sequence and the ``QUERIES_PER_KV``
query heads that share one KV head, stacked into ``BLOCK_M`` rows, so GQA reads
each key once per group. It walks the sequence's keys in tiles of ``TILE_N``
through the block table with an online softmax (float32 accumulation), skipping
tiles that are entirely in the future or, with a sliding window, entirely too far
in the past.

Which sequence a program serves is found on the device by a binary search over
``query_start_loc`` (sequence ``i``'s query blocks start at
``(query_start_loc[i] - query_start_loc[0]) // BLOCK_Q + i``), so the launch
depends only on the token and sequence counts: nothing is read back to the host
and a decode step can be captured in a CUDA graph. A decode-only launch
(``DECODE_ONLY``: every query length is 1) has one program per sequence and
KV head, and no search. Its programs can take the sequences in a given order
(``decode_order``): longest context first, so that no long sequence starts last
and runs alone at the end of the launch; and with ``heads_fastest`` the KV heads
of one sequence run side by side, reading the same cache blocks together. On B1-like
batches the two together raise the KV bandwidth (``benchmarks/kernels_attention.py --sweep-order``;
benchmarks/RESULTS.md, Kernels).

A decode launch may also take each decode's own key and value from the projection's output
(``new_kv``) instead of the cache: the program starts its softmax with them and stores them at
the decode's slot, and with ``rotary`` it rotates the decode's q and k first, as the rotary kernel
would. The TRITON backend does so for split launches only (its ``_fuses_into_decode_launch`` says why).

With ``SPLIT_KV`` each of ``num_splits`` programs takes a share of the key tiles
and writes a partial result (its output, row maximum and row sum);
:func:`_reduce_splits_kernel` merges them. That keeps the GPU busy on decode
batches too small to fill it (batch 1 has only ``num_kv_heads`` programs otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dovetail.attention.backend import RotaryInputs
from dovetail.triton import interpreter_active, next_power_of_2, unaligned
from dovetail.triton.kv_quant import from_cache, to_cache
from dovetail.triton.multiprocessors import multiprocessor_count
from dovetail.triton.pdl import launch_kwargs, pdl_prologue, use_pdl
from dovetail.triton import rotary as rotary_kernel
from dovetail.triton.rotary import normalised


LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _tanh(x):
    # Portable across backends and the interpreter; saturates cleanly at +-1.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence whose first query block is <= ``q_block``."""
    base = tl.load(query_start_loc_ptr)
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = (tl.load(query_start_loc_ptr + mid) - base) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _rope_rows(row_ptrs, row_mask, dims, dim_valid, partner, cos, sin, norm_ptr, eps, HEAD_SIZE: tl.constexpr,
               QK_NORM: tl.constexpr, NORM_WEIGHT_FP32: tl.constexpr, dtype: tl.constexpr):
    """Rows of heads (``row_ptrs`` ``[R, 1]``) rotated as :mod:`dovetail.triton.rotary` rotates them, rounded
    alike: ``x * cos + x[partner] * sin`` per feature (``sin`` already negated on the first half), after the
    per-head RMSNorm with ``QK_NORM``."""
    mask = row_mask & dim_valid[None, :]
    x = tl.load(row_ptrs + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(row_ptrs + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        rstd = (1.0 / tl.sqrt(tl.sum(x * x, 1) / HEAD_SIZE + eps))[:, None]
        w = tl.load(norm_ptr + dims, mask=dim_valid, other=0.0).to(tl.float32)[None, :]
        w_partner = tl.load(norm_ptr + partner, mask=dim_valid, other=0.0).to(tl.float32)[None, :]
        x = normalised(x, rstd, w, NORM_WEIGHT_FP32, dtype)
        x_partner = normalised(x_partner, rstd, w_partner, NORM_WEIGHT_FP32, dtype)
    return (x * cos[None, :] + x_partner * sin[None, :]).to(dtype)


@triton.jit
def _start_with_new_key(q, m_i, l_i, acc, key, value, slot, owner, key_cache_ptr, value_cache_ptr, kv_head, dims,
                        dim_valid, stride_cache_block, stride_cache_slot, stride_cache_head, scale, softcap,
                        k_scale, v_scale, BLOCK_SIZE: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                        WIDE_OFFSETS: tl.constexpr, KV_FP8: tl.constexpr, ROUND_FP8: tl.constexpr):
    """A decode's own key and value (``[HEAD_PAD]``), straight from the projection's output: the ``owner``
    program starts its online softmax with them and stores them at the token's slot (a negative slot: not
    stored) for later steps; the others start empty."""
    key = to_cache(key, k_scale, key_cache_ptr.dtype.element_ty, KV_FP8, ROUND_FP8)
    value = to_cache(value, v_scale, value_cache_ptr.dtype.element_ty, KV_FP8, ROUND_FP8)
    if owner and slot >= 0:
        block = slot // BLOCK_SIZE
        if not WIDE_OFFSETS:
            block = block.to(tl.int32)
        offset = block * stride_cache_block + (slot % BLOCK_SIZE).to(tl.int32) * stride_cache_slot
        offset += kv_head * stride_cache_head
        tl.store(key_cache_ptr + offset + dims, key, mask=dim_valid)
        tl.store(value_cache_ptr + offset + dims, value, mask=dim_valid)
    # What the cache would give back: the tiles read keys and values as they are stored.
    key = from_cache(key, k_scale, q.dtype, KV_FP8).to(tl.float32)
    value = from_cache(value, v_scale, q.dtype, KV_FP8).to(tl.float32)
    s = tl.sum(q.to(tl.float32) * key[None, :], 1)
    if USE_SOFTCAP:
        s = (softcap * LOG2E) * _tanh(s * (scale / softcap))
    else:
        s = s * (scale * LOG2E)
    # Its weight is exp2(s - s) = 1: the running sum starts at 1 and the output at the value.
    m_i = tl.where(owner, s, m_i)
    l_i = tl.where(owner, 1.0, l_i)
    acc = tl.where(owner, tl.broadcast_to(value[None, :], acc.shape), acc)
    return m_i, l_i, acc


# Per-step values must not select a new compiled kernel: lengths and the table's
# width are plain runtime integers, and the metadata tensors (sliced past the
# decodes for the prefill launch) are not specialised on their alignment.
_PER_STEP_POINTERS = ["block_table_ptr", "seq_lens_ptr", "query_start_loc_ptr", "decode_order_ptr", "new_k_ptr",
                      "new_v_ptr", "slot_ptr", "positions_ptr"]


@triton.jit(do_not_specialize=["num_seqs", "window", "stride_table"], **unaligned(*_PER_STEP_POINTERS))
def _paged_attention_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, out_ptr,
    split_out_ptr, split_max_ptr, split_sum_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr, decode_order_ptr,
    new_k_ptr, new_v_ptr, slot_ptr, positions_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr,
    num_seqs, scale, softcap, window, eps, k_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cache_block, stride_cache_slot, stride_cache_head, stride_table,
    stride_new_kt, stride_new_kh, stride_new_vt, stride_new_vh, stride_cos_sin,
    NUM_HEADS: tl.constexpr, QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, SPLIT_KV: tl.constexpr, IEEE_DOT: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, DECODE_ONLY: tl.constexpr, WIDE_OFFSETS: tl.constexpr, HEADS_FASTEST: tl.constexpr,
    ORDERED: tl.constexpr, NEW_KV: tl.constexpr, ROTARY_HALF: tl.constexpr, QK_NORM: tl.constexpr,
    NORM_WEIGHT_FP32: tl.constexpr, KV_FP8: tl.constexpr, ROUND_FP8: tl.constexpr, USE_PDL: tl.constexpr,
):
    if HEADS_FASTEST:
        q_block = tl.program_id(1)
        kv_head = tl.program_id(0)
    else:
        q_block = tl.program_id(0)
        kv_head = tl.program_id(1)
    # The kernel just before this one never writes the step's metadata: it is read while that kernel finishes.
    base = tl.load(query_start_loc_ptr)
    if DECODE_ONLY:  # one query per sequence, one program per sequence
        if ORDERED:
            seq = tl.load(decode_order_ptr + q_block)
        else:
            seq = q_block
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = 1
        local_block = 0
    else:
        seq = _find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        local_block = q_block - ((q_start - base) // BLOCK_Q + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    pdl_prologue(USE_PDL)
    if not DECODE_ONLY:
        if local_block * BLOCK_Q >= q_len:
            return
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_index = local_block * BLOCK_Q + rows // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (rows // QUERIES_PER_KV < BLOCK_Q) & (q_index < q_len)
    token = (q_start - base + q_index).to(tl.int64)
    q_pos = context_len + q_index
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < HEAD_SIZE
    q_rows = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
    if ROTARY_HALF:  # decodes whose q and k are not rotated yet: the first 2 * ROTARY_HALF features turn here
        position = tl.load(positions_ptr + q_start - base).to(tl.int64)
        first_half = dims < ROTARY_HALF
        turning = dims < 2 * ROTARY_HALF
        pair = tl.where(first_half, dims, dims - ROTARY_HALF)
        cos_sin_row = cos_sin_ptr + position * stride_cos_sin
        # Rounded to the activations' dtype first, as the rotary kernel and the torch definition do.
        cos = tl.load(cos_sin_row + pair, mask=turning, other=1.0).to(q_ptr.dtype.element_ty).to(tl.float32)
        sin = tl.load(cos_sin_row + ROTARY_HALF + pair, mask=turning, other=0.0)
        sin = sin.to(q_ptr.dtype.element_ty).to(tl.float32)
        sin = tl.where(first_half, -sin, sin)
        partner = tl.where(turning, tl.where(first_half, dims + ROTARY_HALF, dims - ROTARY_HALF), dims)
        q = _rope_rows(q_rows, row_valid[:, None], dims, dim_valid, partner, cos, sin, q_norm_ptr, eps, HEAD_SIZE,
                       QK_NORM, NORM_WEIGHT_FP32, q_ptr.dtype.element_ty)
    else:
        q = tl.load(q_rows + dims[None, :], mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    # Keys this program may see: up to its last query, from the window of its first.
    first_pos = context_len + local_block * BLOCK_Q
    kv_end = tl.minimum(first_pos + BLOCK_Q, seq_len)
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(first_pos - window + 1, 0)
    tile_lo = kv_start // TILE_N
    tile_hi = tl.cdiv(kv_end, TILE_N)
    if NEW_KV:  # the decode's own key and value come from new_k / new_v, not from the cache
        tile_hi = tl.cdiv(kv_end - 1, TILE_N)
    if SPLIT_KV:
        split = tl.program_id(2)
        per_split = tl.cdiv(tile_hi - tile_lo, tl.num_programs(2))
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, tile_hi)

    table_row = block_table_ptr + seq.to(tl.int64) * stride_table
    cache_head = kv_head * stride_cache_head
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    if NEW_KV:  # before the loop, so that none of it stays live (in registers) through the loop
        decode_token = (q_start - base).to(tl.int64)
        key_row = new_k_ptr + decode_token * stride_new_kt + kv_head * stride_new_kh
        if ROTARY_HALF:
            key = _rope_rows(key_row + tl.zeros([1, 1], tl.int64), tl.full([1, 1], 1, tl.int1), dims, dim_valid,
                             partner, cos, sin, k_norm_ptr, eps, HEAD_SIZE, QK_NORM, NORM_WEIGHT_FP32,
                             new_k_ptr.dtype.element_ty)
            key = tl.reshape(key, [HEAD_PAD])
        else:
            key = tl.load(key_row + dims, mask=dim_valid, other=0.0)
        value = tl.load(new_v_ptr + decode_token * stride_new_vt + kv_head * stride_new_vh + dims, mask=dim_valid,
                        other=0.0)
        # The last split takes it (the only program without splits), even when its share of the tiles is empty.
        m_i, l_i, acc = _start_with_new_key(
            q, m_i, l_i, acc, key, value, tl.load(slot_ptr + decode_token), tl.program_id(2) == tl.num_programs(2) - 1,
            key_cache_ptr, value_cache_ptr, kv_head, dims, dim_valid, stride_cache_block, stride_cache_slot,
            stride_cache_head, scale, softcap, k_scale, v_scale, BLOCK_SIZE, USE_SOFTCAP, WIDE_OFFSETS, KV_FP8,
            ROUND_FP8)
    for tile in range(tile_lo, tile_hi):
        key_pos = tile * TILE_N + tl.arange(0, TILE_N)
        key_valid = key_pos < kv_end
        block = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0)
        if WIDE_OFFSETS:
            block = block.to(tl.int64)
        kv_offset = block * stride_cache_block + (key_pos % BLOCK_SIZE) * stride_cache_slot + cache_head
        k = tl.load(key_cache_ptr + kv_offset[None, :] + dims[:, None],
                    mask=key_valid[None, :] & dim_valid[:, None], other=0.0)
        k = from_cache(k, k_scale, q_ptr.dtype.element_ty, KV_FP8)
        if IEEE_DOT:
            s = tl.dot(q, k, input_precision="ieee")
        elif DOT_IN_FP32:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32))
        else:
            s = tl.dot(q, k)
        if USE_SOFTCAP:
            s = (softcap * LOG2E) * _tanh(s * (scale / softcap))
        else:
            s = s * (scale * LOG2E)
        if NEW_KV:  # the cache's slot of the decode's own key may be stale: that key was taken first
            visible = key_valid[None, :] & (key_pos[None, :] < q_pos[:, None])
        else:
            visible = key_valid[None, :] & (key_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (key_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        value_valid = key_valid
        if NEW_KV:  # a stale value there could be a NaN, which a zero weight would not cancel
            value_valid = key_pos < kv_end - 1
        v = tl.load(value_cache_ptr + kv_offset[:, None] + dims[None, :],
                    mask=value_valid[:, None] & dim_valid[None, :], other=0.0)
        v = from_cache(v, v_scale, q_ptr.dtype.element_ty, KV_FP8)
        if IEEE_DOT:
            pv = tl.dot(p, v, input_precision="ieee")
        elif DOT_IN_FP32:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if SPLIT_KV:
        split_row = (token * NUM_HEADS + head) * tl.num_programs(2) + tl.program_id(2)
        tl.store(split_out_ptr + split_row[:, None] * HEAD_PAD + dims[None, :], out, mask=row_valid[:, None])
        tl.store(split_max_ptr + split_row, m_i, mask=row_valid)
        tl.store(split_sum_ptr + split_row, l_i, mask=row_valid)
    else:
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


@triton.jit
def _reduce_splits_kernel(
    out_ptr, split_out_ptr, split_max_ptr, split_sum_ptr, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_PAD)
    row = (token * NUM_HEADS + head) * NUM_SPLITS + splits
    m = tl.load(split_max_ptr + row)
    l = tl.load(split_sum_ptr + row)
    m_all = tl.max(m, 0)
    weight = tl.where(l > 0.0, tl.exp2(m - m_all) * l, 0.0)
    partial = tl.load(split_out_ptr + row[:, None] * HEAD_PAD + dims[None, :])
    out = tl.sum(partial * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_SIZE)


#: Whether these kernels run in triton's CPU interpreter (``TRITON_INTERPRET=1``).
#: Its numpy has no bfloat16, so there a bfloat16 dot forms its products in float32
#: (exact, as the GPU's tensor cores do).
INTERPRETED = type(_paged_attention_kernel).__name__ == "InterpretedFunction"


def _needs_wide_offsets(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether offsets into the caches may pass 2**31 elements (then the kernel computes them in int64)."""
    reach = max((key_cache.shape[0] - 1) * key_cache.stride(0), (value_cache.shape[0] - 1) * value_cache.stride(0))
    return reach + key_cache.stride(0) >= 2**31


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes of one launch: ``block_m`` query rows, ``tile_n`` keys per step; ``heads_fastest`` numbers a
    decode launch's programs sequence by sequence, the KV heads of one next to each other (else KV head by KV
    head)."""

    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int
    heads_fastest: bool = False


def default_config(head_size: int, queries_per_kv: int, decode: bool, dtype: torch.dtype = torch.bfloat16,
                   num_splits: int = 1) -> LaunchConfig:
    """Tiles for decode-only or prefill-carrying launches.

    Chosen so that the sm_90 build does not spill registers. Decode launches run the KV heads of a
    sequence side by side (``heads_fastest``: module docstring). Decode launches without KV
    splits (batches that fill the GPU) read 128 keys a step, faster than 64 on B1-like batches of both
    models (``benchmarks/kernels_attention.py --sweep-decode``); split launches (small batches) keep 64,
    so that short contexts still split. Prefill launches take 64 query rows and 32 keys a step with 4
    warps, the fastest of the configurations ``--sweep-prefill`` tries on B1-like prompts
    (benchmarks/RESULTS.md, Kernels).
    """
    head_pad = next_power_of_2(head_size)
    group = next_power_of_2(queries_per_kv)
    wide = dtype == torch.float32 or head_pad > 128
    if decode:
        tile_n = 32 if wide else (128 if num_splits == 1 else 64)
        return LaunchConfig(block_m=max(16, group), tile_n=tile_n, num_warps=4, num_stages=2, heads_fastest=True)
    if wide:
        return LaunchConfig(block_m=max(32, group), tile_n=32, num_warps=4, num_stages=2)
    return LaunchConfig(block_m=max(64, group), tile_n=32, num_warps=4, num_stages=2)


def default_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """KV splits for a decode launch: enough programs to fill the device about twice (at most 16), and
    at least 8 while the launch has no more programs (sequences x KV heads) than multiprocessors, 2 up
    to twice as many.

    The floors are from ``benchmarks/kernels_attention.py --sweep-splits`` (contexts 500-2048, 8 KV heads):
    at 8-32 sequences these splits read the cache faster than fewer, and from 64 sequences on an unsplit
    launch was best or close to it (benchmarks/RESULTS.md, Kernels).
    """
    programs = max(1, num_seqs * num_kv_heads)
    multiprocessors = multiprocessor_count(device)
    splits = 1
    while splits < 16 and programs * splits <= multiprocessors:
        splits *= 2
    if programs <= multiprocessors:
        return max(splits, 8)
    return 2 if programs <= 2 * multiprocessors else 1


def rotary_fits(rotary: RotaryInputs, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether a decode launch can apply ``rotary`` to ``q`` and ``k`` (``[tokens, heads, head_size]``): what the
    rotary kernel accepts (:func:`dovetail.triton.rotary.supports`, ``supports_qk_norm``), with a float32 table."""
    head_size, cache = q.shape[-1], rotary.cos_sin_cache
    fits = (cache.dtype == torch.float32 and cache.dim() == 2
            and rotary_kernel.supports(rotary.positions, q.flatten(1), k.flatten(1), cache, head_size,
                                       rotary.rotary_dim))
    if rotary.q_norm_weight is None or not fits:
        return fits
    return rotary.k_norm_weight is not None and rotary_kernel.supports_qk_norm(
        rotary.q_norm_weight, rotary.k_norm_weight, q, head_size, rotary.rotary_dim)


def _rotary_tensors(rotary: RotaryInputs | None, q: torch.Tensor) -> tuple:
    """positions, cos/sin cache, q and k norm weights; ``q`` where unused. (A placeholder must be aligned as
    ``q`` is, whatever the step: a pointer that is specialised on its alignment, such as the cos/sin cache's,
    given ``seq_lens[n:]`` of a step with an odd number of decodes compiled a second prefill launch inside the
    benchmark's timed call, as ``benchmarks/triton_compiles.py`` showed.)"""
    if rotary is None:
        return q, q, q, q
    norm = rotary.q_norm_weight is not None
    return (rotary.positions, rotary.cos_sin_cache, rotary.q_norm_weight if norm else q,
            rotary.k_norm_weight if norm else q)


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    num_tokens: int, num_seqs: int, scale: float, sliding_window: int | None = None,
                    logit_softcap: float | None = None, decode: bool = False, num_splits: int = 1,
                    config: LaunchConfig | None = None, decode_order: torch.Tensor | None = None,
                    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    rotary: RotaryInputs | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Attend ``num_seqs`` sequences whose queries are ``num_tokens`` rows of ``q``, into ``out``.

    ``q`` and ``out`` are ``[tokens, num_heads, head_size]``; their row 0 is the
    first query of the first sequence, whatever ``query_start_loc[0]`` holds (so a
    batch's tail is attended with ``q[n:]``, ``out[n:]`` and ``query_start_loc[i:]``).
    ``key_cache`` and ``value_cache`` are ``[num_blocks, block_size, kv_heads, head_size]``.
    ``decode`` says every query length is 1 (one program per sequence, decode tiles); ``num_splits`` > 1
    splits each sequence's keys over that many programs and merges them after. ``decode_order`` (decode only):
    int32 ``[num_seqs]``, a permutation of the sequences in the order their programs take them
    (the TRITON backend's metadata builder passes longest context first); None takes them as they come.
    ``new_kv`` (decode only): ``(k, v, slot_mapping)`` of this step's tokens, rows as in ``q``. Each decode
    then attends its own key and value from ``k`` and ``v`` instead of the cache, and stores them at its
    slot, so that no separate KV-cache write is launched for the decodes (a negative slot is not stored).
    ``rotary`` (with ``new_kv``, where :func:`rotary_fits`): the decodes' rows of ``q`` and ``k`` are not
    rotated yet; the launch rotates them (after the per-head norms, when given) as the rotary kernel would.
    An FP8 (``float8_e4m3fn``) cache holds keys / ``k_scale`` and values / ``v_scale``
    (:mod:`dovetail.triton.kv_quant`): tiles are dequantised to ``q``'s dtype as they are loaded.
    """
    if num_seqs == 0 or num_tokens == 0:
        return
    num_heads, head_size = q.shape[1], q.shape[2]
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    queries_per_kv = num_heads // num_kv_heads
    cfg = config or default_config(head_size, queries_per_kv, decode, q.dtype, num_splits)
    block_q = 1 if decode else cfg.block_m // queries_per_kv
    head_pad = next_power_of_2(head_size)
    num_q_blocks = num_seqs if decode else num_tokens // block_q + num_seqs
    split_kv = num_splits > 1
    if split_kv:
        split_out = torch.empty((num_tokens, num_heads, num_splits, head_pad), dtype=torch.float32, device=q.device)
        split_max = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
        split_sum = torch.empty_like(split_max)
    else:
        split_out = split_max = split_sum = out
    if new_kv is not None and not decode:
        raise ValueError("new_kv is for decode launches only: a prefill's queries read each other's keys "
                         "from the cache, so they must be written first")
    if rotary is not None and (new_kv is None or not rotary_fits(rotary, q, new_kv[0])):
        raise ValueError("rotary needs new_kv, and inputs that rotary_fits accepts")
    new_k, new_v, slots = new_kv if new_kv is not None else (q, q, seq_lens)
    if new_k.stride(-1) != 1:
        new_k = new_k.contiguous()
    if new_v.stride(-1) != 1:
        new_v = new_v.contiguous()
    heads_fastest = decode and cfg.heads_fastest and num_q_blocks < 65536
    grid = (num_kv_heads, num_q_blocks, num_splits) if heads_fastest else (num_q_blocks, num_kv_heads, num_splits)
    launch = launch_kwargs(use_pdl(q.device))
    fp8 = key_cache.dtype == torch.float8_e4m3fn
    if fp8 and value_cache.dtype != key_cache.dtype:
        raise ValueError("an FP8 key cache needs an FP8 value cache")
    _paged_attention_kernel[grid](
        q, key_cache, value_cache, out, split_out, split_max, split_sum,
        block_table, seq_lens, query_start_loc, decode_order if decode_order is not None else seq_lens,
        new_k, new_v, slots, *_rotary_tensors(rotary, q),
        num_seqs, float(scale), float(logit_softcap or 1.0), int(sliding_window or 0),
        float(rotary.eps) if rotary is not None else 0.0, float(k_scale), float(v_scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1),
        rotary.cos_sin_cache.stride(0) if rotary is not None else 0,
        NUM_HEADS=num_heads, QUERIES_PER_KV=queries_per_kv, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size, BLOCK_M=cfg.block_m, BLOCK_Q=block_q, TILE_N=cfg.tile_n,
        USE_SOFTCAP=bool(logit_softcap), USE_WINDOW=bool(sliding_window), SPLIT_KV=split_kv,
        IEEE_DOT=q.dtype == torch.float32, DOT_IN_FP32=INTERPRETED and q.dtype == torch.bfloat16,
        DECODE_ONLY=decode, WIDE_OFFSETS=_needs_wide_offsets(key_cache, value_cache), HEADS_FASTEST=heads_fastest,
        ORDERED=decode and decode_order is not None, NEW_KV=new_kv is not None,
        ROTARY_HALF=rotary.rotary_dim // 2 if rotary is not None else 0,
        QK_NORM=rotary is not None and rotary.q_norm_weight is not None,
        NORM_WEIGHT_FP32=rotary is not None and rotary.q_norm_weight is not None
        and rotary.q_norm_weight.dtype == torch.float32, KV_FP8=fp8, ROUND_FP8=fp8 and interpreter_active(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch,
    )
    if split_kv:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            out, split_out, split_max, split_sum, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, NUM_SPLITS=num_splits, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
            num_warps=4 if head_pad >= 128 else 2, **launch,
        )
