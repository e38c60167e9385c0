"""Greedy sampling's argmax over a vocabulary-sized row, for a few rows, in two short Triton launches.

torch's ``argmax(dim=-1)`` reduces each row in one thread block, which leaves a GPU nearly idle for a
vocabulary-sized row: a visible share of a batch-1 decode step (``benchmarks/profile_step.py``;
benchmarks/RESULTS.md, Kernels).
Here the first launch splits each row into ``BLOCK``-wide chunks, one program each, and keeps each
chunk's maximum and its first index; the second reduces the chunks of a row. Ties go to the lowest
index, as torch's do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dovetail.triton import next_power_of_2
from dovetail.triton.pdl import launch_kwargs, pdl_prologue, use_pdl

BLOCK = 4096
#: Rows up to which :func:`argmax` takes a tensor (a decode step's few sequences); more rows fill the GPU anyway.
MAX_ROWS = 64


@triton.jit
def _chunk_max_kernel(x_ptr, value_ptr, index_ptr, n_cols, stride_row, n_chunks, BLOCK: tl.constexpr,
                      USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    value, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(value_ptr + row * n_chunks + chunk, value)
    tl.store(index_ptr + row * n_chunks + chunk, chunk * BLOCK + index)


@triton.jit
def _row_max_kernel(value_ptr, index_ptr, out_ptr, n_chunks, CHUNKS: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS)
    values = tl.load(value_ptr + row * n_chunks + chunks, mask=chunks < n_chunks, other=float("-inf"))
    best = tl.argmax(values, axis=0, tie_break_left=True)  # chunks are in column order: the first is the lowest
    tl.store(out_ptr + row, tl.load(index_ptr + row * n_chunks + best).to(tl.int64))


def supports(logits: torch.Tensor) -> bool:
    """A 2-D float tensor of up to :data:`MAX_ROWS` rows with unit column stride."""
    return (logits.dim() == 2 and 0 < logits.shape[0] <= MAX_ROWS and logits.shape[1] > 0 and logits.stride(1) == 1
            and logits.dtype in (torch.float32, torch.float16, torch.bfloat16))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (int64) for logits :func:`supports` takes; rows without NaN."""
    rows, cols = logits.shape
    n_chunks = triton.cdiv(cols, BLOCK)
    values = torch.empty((rows, n_chunks), dtype=torch.float32, device=logits.device)
    indices = torch.empty((rows, n_chunks), dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    pdl = launch_kwargs(use_pdl(logits.device))
    _chunk_max_kernel[(rows, n_chunks)](logits, values, indices, cols, logits.stride(0), n_chunks, BLOCK=BLOCK,
                                        num_warps=8, **pdl)
    _row_max_kernel[(rows,)](values, indices, out, n_chunks, CHUNKS=max(16, next_power_of_2(n_chunks)),
                             num_warps=1, **pdl)
    return out
