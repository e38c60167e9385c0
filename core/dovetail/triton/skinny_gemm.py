"""GEMM for decode batches (17 to 256 token rows) of 16-bit weights, with the weight on the tensor cores' wide side.

A decode step's linear ``x [M, K] @ weight[N, K].T`` has few rows of ``x`` and a weight that is read once and is
most of the bytes. This kernel swaps the operands: each program multiplies a ``BLOCK_N x BLOCK_K`` weight tile (the
tensor-core product's M side, 64 rows an instruction) by every row of ``x`` at once (its N side, 16 to 256 wide),
so the weight streams through once and no token rows are padded to 64. Both operands arrive through tensor
descriptors (bulk copies on Hopper), and K is split among programs until the launch fills the device, with the
same deterministic last-program reduction as :mod:`dovetail.triton.gemv`: each split stores its float32 partial
sums and the last of a tile's programs to finish adds them in split order. One launch, no host synchronisation.

Under programmatic dependent launch the weight's first tiles do not depend on the kernel before (weights do not
change within a step), so with ``prefetch`` each program asks L2 for them before it waits for that kernel.

:func:`supports` says which operands take it; :class:`SkinnyConfig` holds the launch parameters.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dovetail.triton import interpreter_active, next_power_of_2
from dovetail.triton.gemv import _tile_counters
from dovetail.triton.multiprocessors import multiprocessor_count
from dovetail.triton.pdl import launch_kwargs, pdl_launch_dependents, pdl_wait, use_pdl

#: The most token rows one program multiplies (the widest N side of a Hopper tensor-core product).
MAX_ROWS = 256


@triton.jit
def _skinny_gemm_kernel(
    x_desc, w_desc, w_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, stride_wn, stride_om, tiles_per_split, split_k,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, IEEE: tl.constexpr, PREFETCH: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    k_tiles = tl.cdiv(K, BLOCK_K)
    t_start = pid_k * tiles_per_split
    t_end = tl.minimum(k_tiles, t_start + tiles_per_split)
    if PREFETCH > 0:  # the weight is not written by the kernel before: bring its first tiles into L2 meanwhile
        rows = tl.minimum(n0 + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
        for t in tl.static_range(PREFETCH):
            k0 = tl.minimum(t_start + t, t_end - 1) * BLOCK_K
            for c in tl.static_range(0, BLOCK_K, 64):  # one 128-byte line a row
                tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                          [w_ptr + rows * stride_wn + k0 + c], dtype=tl.int32, is_pure=False, pack=1)
    pdl_wait(USE_PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for t in range(t_start, t_end):
        k0 = t * BLOCK_K
        w = w_desc.load([n0, k0])
        x = x_desc.load([0, k0])
        if IEEE:
            acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    pdl_launch_dependents(USE_PDL)
    cols = n0 + tl.arange(0, BLOCK_N)
    rows_m = tl.arange(0, BLOCK_M)
    out_mask = (cols[:, None] < N) & (rows_m[None, :] < M)
    if SPLIT:
        parts = part_ptr + rows_m[None, :].to(tl.int64) * N + cols[:, None]
        tl.store(parts + pid_k * M * N, acc, mask=out_mask)
        tl.debug_barrier()
        tile = count_ptr + pid_n
        done = tl.atomic_add(tile, 1, sem="acq_rel")
        if done == split_k - 1:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(split_k):  # in split order, whichever program is last: deterministic
                acc += tl.load(parts + s * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(tile, 0)
            _store(acc, bias_ptr, out_ptr, cols, rows_m, out_mask, stride_om, N, HAS_BIAS)
    else:
        _store(acc, bias_ptr, out_ptr, cols, rows_m, out_mask, stride_om, N, HAS_BIAS)


@triton.jit
def _store(acc, bias_ptr, out_ptr, cols, rows_m, out_mask, stride_om, N, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rows_m[None, :].to(tl.int64) * stride_om + cols[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=out_mask)


class SkinnyConfig(NamedTuple):
    """Launch parameters of :func:`skinny_gemm`: the weight tile, pipeline stages, warps, the split of K (0: chosen
    so the launch has about ``programs_per_sm`` programs a multiprocessor) and the weight tiles prefetched into L2
    before the wait for the kernel before."""

    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 0
    prefetch: int = 0
    programs_per_sm: int = 1


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`skinny_gemm` takes these operands: 16-bit ``x`` rows of one dtype with ``weight [N, K]``, at
    most :data:`MAX_ROWS` rows, both with rows of whole 16-byte units from 16-byte aligned starts (what tensor
    descriptors need)."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or x.dtype != weight.dtype:
        return False
    if x.dtype not in (torch.float16, torch.bfloat16) or (bias is not None and bias.shape != (weight.shape[0],)):
        return False
    k = weight.shape[1]
    rows = x.numel() // k if k else 0
    return (0 < rows <= MAX_ROWS and weight.is_contiguous() and k * 2 % 16 == 0 and weight.data_ptr() % 16 == 0
            and x.data_ptr() % 16 == 0)


def split_for(n: int, k: int, config: SkinnyConfig, multiprocessors: int) -> int:
    """The split of K: ``config.split_k``, or the most that keeps the launch within ``programs_per_sm`` programs a
    multiprocessor and each split at least two K tiles."""
    if config.split_k:
        return config.split_k
    tiles = triton.cdiv(n, config.block_n)
    k_tiles = triton.cdiv(k, config.block_k)
    split = max(1, (config.programs_per_sm * multiprocessors) // tiles)
    return max(1, min(split, k_tiles // 2))


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: SkinnyConfig | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for at most :data:`MAX_ROWS` rows of ``x`` (:func:`supports`)."""
    if not supports(x, weight, bias):
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype} "
                         f"are not 16-bit operands of at most {MAX_ROWS} rows with 16-byte aligned rows")
    from triton.tools.tensor_descriptor import TensorDescriptor

    cfg = config or SkinnyConfig()
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or x2.stride(0) != k:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = max(16, next_power_of_2(m))
    split = split_for(n, k, cfg, multiprocessor_count(x.device))
    k_tiles = triton.cdiv(k, cfg.block_k)
    tiles_per_split = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, tiles_per_split)  # no empty splits
    grid = (triton.cdiv(n, cfg.block_n), split)
    if split == 1:
        part = counts = out
    else:
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counts = _tile_counters(x.device, grid[0])
    x_desc = TensorDescriptor.from_tensor(x2, [block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])
    pdl = use_pdl(x.device)
    _skinny_gemm_kernel[grid](
        x_desc, w_desc, weight, bias if bias is not None else out, out, part, counts, m, n, k, weight.stride(0),
        out.stride(0), tiles_per_split, split, HAS_BIAS=bias is not None, SPLIT=split > 1, BLOCK_M=block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IEEE=interpreter_active(), PREFETCH=cfg.prefetch if pdl and not interpreter_active() else 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs(pdl))
    return out.reshape(*x.shape[:-1], n)


@functools.lru_cache(maxsize=None)
def default_config(m: int, n: int, k: int) -> SkinnyConfig:
    """The launch parameters for ``m`` rows (to be retuned by ``benchmarks/kernels_linear.py --skinny``)."""
    block_m = max(16, next_power_of_2(m))
    return SkinnyConfig(block_n=64 if block_m >= 256 else 128, block_k=64, num_warps=4,
                        num_stages=4 if block_m >= 256 else 5)
