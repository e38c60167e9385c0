"""LoRA's expand step in one kernel: each token's share of the stacked ``A`` products, masked to its own
slot, times the slots' stacked ``B``, added into the layer's output (see :mod:`dovetail.lora.layer`).

In torch that is a multiply by the mask and one matrix product per merged part, each its own launch; in a
decode step of a model with four linear layers a block those launches cost more than their work. Here a
program takes a tile of tokens and of output columns, within one merged part (each part's size a multiple of
the column tile), and contracts over every slot's rank at once: ``slots * rank`` is small (16 to 256).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_TOKENS = 16
BLOCK_COLUMNS = 64
#: The most tokens the kernel takes: a decode step's. Above, a prefill's products are large enough that torch's
#: multiply and one product a part ran faster (llama-3.1-8b's prefill steps on an H100: 390 against 412 ms).
MAX_TOKENS = 512


@triton.jit
def _lora_expand_kernel(shrunk_ptr, mask_ptr, b_ptr, out_ptr, num_tokens, num_columns, part_end_1, part_end_2,
                        shrunk_stride, out_stride, b_stride,
                        NUM_SLOTS: tl.constexpr, RANK: tl.constexpr, WIDTH: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, EXACT: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    first_column = tl.program_id(1) * BLOCK_N
    columns = first_column + tl.arange(0, BLOCK_N)
    part = (first_column >= part_end_1).to(tl.int32) + (first_column >= part_end_2).to(tl.int32)
    k = tl.arange(0, WIDTH)
    in_rank = k < NUM_SLOTS * RANK
    rows_ok = tokens < num_tokens
    tile = rows_ok[:, None] & in_rank[None, :]
    shrunk = tl.load(shrunk_ptr + tokens[:, None] * shrunk_stride + part * (NUM_SLOTS * RANK) + k[None, :],
                     mask=tile, other=0.0)
    own_slot = tl.load(mask_ptr + tokens[:, None] * NUM_SLOTS + k[None, :] // RANK, mask=tile, other=0.0)
    shrunk = shrunk.to(tl.float32) * own_slot.to(tl.float32)
    b = tl.load(b_ptr + k[:, None] * b_stride + columns[None, :],
                mask=in_rank[:, None] & (columns[None, :] < num_columns), other=0.0).to(tl.float32)
    if EXACT:  # float32 weights: no TF32 rounding
        update = tl.dot(shrunk, b, input_precision="ieee")
    else:  # 16-bit weights hold no more bits than TF32 takes
        update = tl.dot(shrunk, b)
    out_tile = out_ptr + tokens[:, None] * out_stride + columns[None, :]
    out_ok = rows_ok[:, None] & (columns[None, :] < num_columns)
    out = tl.load(out_tile, mask=out_ok, other=0.0).to(tl.float32) + update
    tl.store(out_tile, out.to(out_ptr.dtype.element_ty), mask=out_ok)


def supports(tokens: int, out_sizes: list[int]) -> bool:
    """Whether the kernel takes this many tokens of a layer of these merged output parts (at most three, each a
    whole number of column tiles)."""
    return tokens <= MAX_TOKENS and len(out_sizes) <= 3 and all(size % BLOCK_COLUMNS == 0 for size in out_sizes)


def lora_expand(shrunk: torch.Tensor, mask: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                out_sizes: list[int], rank: int) -> torch.Tensor:
    """``out[:, part p] += (shrunk[:, part p] * each token's slot mask) @ b[:, part p]``, in place.

    ``shrunk`` is ``[tokens, parts * slots * rank]``, ``mask`` the one-hot ``[tokens, slots]``, ``b``
    ``[slots * rank, sum(out_sizes)]``; ``out`` and ``b`` contiguous by rows.
    """
    tokens, slots = mask.shape
    ends = [sum(out_sizes[:i + 1]) for i in range(len(out_sizes))][:-1] + [1 << 30] * (3 - len(out_sizes))
    width = max(16, triton.next_power_of_2(slots * rank))
    grid = (triton.cdiv(tokens, BLOCK_TOKENS), triton.cdiv(out.shape[1], BLOCK_COLUMNS))
    _lora_expand_kernel[grid](shrunk, mask, b, out, tokens, out.shape[1], ends[0], ends[1], shrunk.stride(0),
                              out.stride(0), b.stride(0), NUM_SLOTS=slots, RANK=rank, WIDTH=width,
                              BLOCK_T=BLOCK_TOKENS, BLOCK_N=BLOCK_COLUMNS, EXACT=b.dtype == torch.float32)
    return out
