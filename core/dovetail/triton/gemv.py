"""GEMV for a few tokens, in Triton: weight-only FP8 (W8A16) and plain 16-bit weights.

:func:`fp8_gemv` computes ``x @ (weight * scale[:, None]).T + bias`` for an FP8 e4m3 weight
``[N, K]`` with one float32 scale per output channel. The activations stay in their own dtype
(no per-token quantization kernels before the product), so at batch 1 to 16 the cost is one
pass over the FP8 weight: half the bytes of a bfloat16 GEMV. :func:`gemv` is the same kernel on
a float16/bfloat16 weight without scales (``F.linear``); at one token it beats cuBLAS on
Hopper GPUs (``TritonFusedOps.linear`` uses it there; benchmarks/RESULTS.md, Kernels).

:func:`gemv_gated` is the same kernel over a merged ``[gate | up]`` weight ``[2N, K]`` with the MLP's gated
activation applied before the store: a program reads the gate and the up rows of its outputs, so one launch
replaces the product and the activation's kernel (``TritonFusedOps.linear_gated``, up to 16 tokens; on an H100
it took 0.6-3% off batch-1 decode and 2-4% off decode steps of 8 sequences, benchmarks/RESULTS.md).

Each program owns ``BLOCK_N`` outputs for ``BLOCK_M`` rows of ``x`` (all of them for M <= 16),
streams its weight rows over K (or over one of ``SPLIT_K`` slices of K) in ``BLOCK_K`` chunks,
converts them and accumulates in float32; the per-channel scale and the bias are applied once at
the end. Two ways to multiply (:class:`GemvConfig` ``dot``):

- ``dot=True`` (what :func:`default_config` picks): ``tl.dot`` on the tensor cores with the rows
  padded to 16 and the weight converted to x's 16-bit dtype through float16 (exact for every e4m3
  value); float32 x takes an IEEE float32 dot. Its weight loads are software-pipelined.
- ``dot=False``: products summed in float32 registers, one ``[BLOCK_M, BLOCK_N, BLOCK_K]``
  accumulator reduced over K after the loop: the default for 16-bit weights at up to 4 rows;
  slower than the dot for FP8 on Hopper (converting each weight costs more than the load).

With ``SPLIT_K > 1`` each program writes its float32 partial sums to a scratch tensor
``[SPLIT_K, M, N]`` and counts itself done on an int32 counter of its output tile (one atomic add);
the last of a tile's ``SPLIT_K`` programs to finish adds the partial sums up in slice order (the
result does not depend on which program is last), finishes the tile and resets the counter to
zero. One launch, no host synchronisation: it is captured by CUDA graphs. The counters are kept
per device, so two split-K launches must not run at once on different streams of one device.

On the CPU (``TRITON_INTERPRET=1``) triton's interpreter loads ``float8_e4m3fn`` tensors and
converts them exactly (tests/test_gemv.py checks all 254 finite byte values through this
kernel), so CI runs the kernel itself and no bit-decoding stand-in is needed. Only the
tensor-core dot runs in float32 there (numpy has no bfloat16), which gives the same products:
e4m3 and bfloat16/float16 values and their products are exact in float32.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dovetail.triton import next_power_of_2
from dovetail.triton.activation import act_and_mul_rounded
from dovetail.triton.multiprocessors import multiprocessor_count
from dovetail.triton.pdl import launch_kwargs, pdl_launch_dependents, pdl_wait, use_pdl


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every token count
def _gemv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, k_chunk,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT: tl.constexpr, DOT_FP32: tl.constexpr, W_FP8: tl.constexpr, HAS_SCALE: tl.constexpr,
    USE_PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr, EVEN: tl.constexpr, GATED: tl.constexpr,
    GELU_TANH: tl.constexpr,
):
    pdl_wait(USE_PDL)
    if PDL_TRIGGER == 1:
        pdl_launch_dependents(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    if GATED:  # N outputs of [gate | up]: weight rows N + cols are the up projection's of the same outputs
        up_rows = w_ptr + (cols + N)[:, None].to(tl.int64) * stride_wn
    k_start = pid_k * k_chunk
    k_end = tl.minimum(K, k_start + k_chunk)
    if DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if GATED:
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        if GATED:
            acc3_up = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if EVEN:  # the tiles divide N and K: only x's rows past M are masked
            w = tl.load(w_rows + ks[None, :])
            if GATED:
                w_up = tl.load(up_rows + ks[None, :])
            a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None], other=0.0)
        else:
            k_ok = ks < K
            w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if GATED:
                w_up = tl.load(up_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT:
            acc = _accumulate(acc, a, w, DOT, DOT_FP32, W_FP8)
            if GATED:
                acc_up = _accumulate(acc_up, a, w_up, DOT, DOT_FP32, W_FP8)
        else:
            acc3 = _accumulate(acc3, a, w, DOT, DOT_FP32, W_FP8)
            if GATED:
                acc3_up = _accumulate(acc3_up, a, w_up, DOT, DOT_FP32, W_FP8)
    if PDL_TRIGGER == 2:
        pdl_launch_dependents(USE_PDL)
    if not DOT:
        acc = tl.sum(acc3, axis=2)
        if GATED:
            acc_up = tl.sum(acc3_up, axis=2)
    if not GATED:
        acc_up = acc  # unused
    out_mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K > 1:
        # Each slice stores its partial sums; the last of this tile's programs to finish (counted in
        # count_ptr, which it resets to 0 for the next call) adds them up. A gated slice's are [gate | up].
        part_n = 2 * N if GATED else N
        parts = part_ptr + rows[:, None].to(tl.int64) * part_n + cols[None, :]
        tl.store(parts + pid_k * M * part_n, acc, mask=out_mask)
        if GATED:
            tl.store(parts + pid_k * M * part_n + N, acc_up, mask=out_mask)
        tl.debug_barrier()
        tile = count_ptr + pid_m * tl.num_programs(0) + pid_n
        done = tl.atomic_add(tile, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # in slice order, whichever program is last: deterministic
                acc += tl.load(parts + s * M * part_n, mask=out_mask, other=0.0, cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(parts + s * M * part_n + N, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(tile, 0)
            _finish(acc, acc_up, scale_ptr, bias_ptr, out_ptr, rows, cols, col_ok, out_mask, stride_om, N, HAS_BIAS,
                    HAS_SCALE, GATED, GELU_TANH)
    else:
        _finish(acc, acc_up, scale_ptr, bias_ptr, out_ptr, rows, cols, col_ok, out_mask, stride_om, N, HAS_BIAS,
                HAS_SCALE, GATED, GELU_TANH)


@triton.jit
def _accumulate(acc, a, w, DOT: tl.constexpr, DOT_FP32: tl.constexpr, W_FP8: tl.constexpr):
    """``acc`` plus this K step's products: ``[BLOCK_M, BLOCK_N]`` with ``DOT``, else the register sums'
    ``[BLOCK_M, BLOCK_N, BLOCK_K]``."""
    # e4m3 -> float16 is one packed conversion per two values (and exact); triton's direct
    # e4m3 -> bfloat16 costs several, which made the kernel compute-bound on Hopper.
    if W_FP8:
        w = w.to(tl.float16)
    if DOT:
        if DOT_FP32:
            acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w.to(a.dtype)))
    else:
        acc += a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    return acc


@triton.jit
def _scaled(acc, scale_ptr, bias_ptr, cols, col_ok, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr):
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _finish(acc, acc_up, scale_ptr, bias_ptr, out_ptr, rows, cols, col_ok, out_mask, stride_om, N,
            HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, GATED: tl.constexpr, GELU_TANH: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    out = _scaled(acc, scale_ptr, bias_ptr, cols, col_ok, HAS_BIAS, HAS_SCALE)
    if GATED:  # gate and up rounded to the output's dtype first, as the unfused product writes them
        up = _scaled(acc_up, scale_ptr, bias_ptr, cols + N, col_ok, HAS_BIAS, HAS_SCALE)
        out = act_and_mul_rounded(out.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype, GELU_TANH)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], out.to(dtype), mask=out_mask)


#: Whether triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``), whose numpy has no bfloat16.
INTERPRETED = type(_gemv_kernel).__name__ == "InterpretedFunction"


class GemvConfig(NamedTuple):
    """Launch parameters of :func:`fp8_gemv` and :func:`gemv`; ``dot`` picks tensor cores over register sums."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    split_k: int = 1
    dot: bool = False
    #: When the next kernel may launch under PDL: 0 when this one completes, 1 at its start, 2 after the main
    #: loop (the fastest in batch-1 decode, where small kernels sit between the GEMVs).
    pdl_trigger: int = 2
    #: Rows of x a program takes with ``dot`` (at least 16): each block of rows reads the whole weight.
    block_m: int = 16


def register_sum_wave(block_k: int, multiprocessors: int) -> int:
    """Programs of 8 weight rows by ``block_k`` that the register-sum GEMV runs in one wave: 32K weight elements in
    flight a multiprocessor (4 programs at 1,024 of K). Fitted to H100 timings, not derived from a
    resource count: 8-row blocks won on 512 programs and lost on 640 at 1,024 of K, and won on 640 at 512."""
    return multiprocessors * (32768 // (8 * block_k))


#: Split K until a launch has at least this many programs (about three per multiprocessor of a Hopper GPU).
MIN_PROGRAMS = 384


def split_k_for(n: int, k: int, block_n: int, block_k: int, m: int = 1, block_m: int = 16) -> int:
    """Slices of K for tiles of ``block_n`` x ``block_k`` (``m`` rows in blocks of ``block_m``): doubled until
    there are ``MIN_PROGRAMS`` programs, while each slice keeps at least two steps of K and the float32 partial
    sums (``split * m * n``) weigh no more than a 16-bit weight (``n * k``)."""
    split_k = 1
    programs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    while (programs * split_k < MIN_PROGRAMS and k >= 4 * block_k * split_k
           and (2 * split_k) * m * 4 <= k * 2):  # float32 partial sums of the doubled split, per output
        split_k *= 2
    return split_k


@functools.lru_cache(maxsize=None)
def default_config(m: int, n: int, k: int, weight_bytes: int = 1, multiprocessors: int = 132) -> GemvConfig:
    """The launch parameters for ``x [m, k] @ weight[n, k].T`` on a device of ``multiprocessors``: the heuristic to
    retune.

    16-bit weights (``weight_bytes=2``) at up to 4 rows: register sums, unsplit, 3 stages, 1,024 of K per step at
    one row (halved per doubling of the rows, and halved again, down to 256, while it does not divide K: masked
    loads were slower), over 8 weight rows a program while the launch fits :func:`register_sum_wave` with more
    programs than multiprocessors, else over 4 (twice the programs: every multiprocessor busy, or the last wave
    evened out). On an H100 that was the fastest or within 1% of it on every layer linear and LM head of
    qwen3-0.6b, llama-3.1-8b, and a TP=2 rank of llama-3.1-8b and qwen3-32b (benchmarks/RESULTS.md, Kernels).

    Otherwise the tensor-core dot over 64 weight rows and up to 64 rows of x (more rows read the weight once per
    block of rows, from L2 after the first), K split until there are ``MIN_PROGRAMS`` programs.
    For K of 4,096 or more, 256 of K per step and 3 pipeline stages (faster than 128 of K on every
    llama-3.1-8b linear; a fourth stage leaves shared memory for two programs per multiprocessor instead
    of three). Shorter K, 128 per step, 5 stages unsplit and 3 split (256 of K was slower on qwen3-0.6b's
    linears). ``benchmarks/kernels_linear.py --configs`` retunes it; benchmarks/RESULTS.md, Kernels.
    """
    if weight_bytes == 2 and m <= 4:
        widest = 1024 // next_power_of_2(m)
        block_k = widest
        while k % block_k and block_k > 256:
            block_k //= 2
        block_k = block_k if k % block_k == 0 else widest
        block_n = 8 if multiprocessors < triton.cdiv(n, 8) <= register_sum_wave(block_k, multiprocessors) else 4
        return GemvConfig(block_n, block_k, num_warps=4, num_stages=3)
    block_m = min(64, max(16, next_power_of_2(m)))
    if k >= 4096:
        return GemvConfig(64, 256, num_warps=4, num_stages=3, split_k=split_k_for(n, k, 64, 256, m, block_m),
                          dot=True, block_m=block_m)
    split_k = split_k_for(n, k, 64, 128, m, block_m)
    return GemvConfig(64, 128, num_warps=4, num_stages=5 if split_k == 1 else 3, split_k=split_k, dot=True,
                      block_m=block_m)


@functools.lru_cache(maxsize=None)
def gated_config(m: int, rows: int, k: int, multiprocessors: int = 132) -> GemvConfig:
    """The gated GEMV's launch parameters for ``x [m, k]`` and a 16-bit ``[gate | up]`` weight of ``rows`` rows.

    One row: :func:`default_config`'s register sums over the whole weight. 2 to 16 rows: the tensor-core dot over
    16 rows of x, 128 of K a step, 3 stages, unsplit, over 64 weight rows a program (32 outputs) while that makes
    at least three programs a multiprocessor, else 32. On an H100 that was the fastest of ``kernels_linear.py
    --gated-configs``'s grid, or within 1% of it, at 2-16 rows on llama-3.1-8b, its TP=2 rank and a qwen3-32b
    TP=2 rank (benchmarks/RESULTS.md, Kernels). More rows: :func:`default_config`.
    """
    if m == 1 or m > 16:
        return default_config(m, rows, k, 2, multiprocessors)
    block_n = 64 if triton.cdiv(rows, 64) >= 3 * multiprocessors else 32
    return GemvConfig(block_n, 128, num_warps=4, num_stages=3, split_k=1, dot=True, block_m=16)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
             config: GemvConfig | None = None) -> torch.Tensor:
    """``(x.float() @ (weight.float() * weight_scale[:, None]).T + bias)`` in x's dtype.

    - ``x``: ``[..., K]`` float32, float16 or bfloat16, a few rows (any number works; the
      weight is read once per 16 rows).
    - ``weight``: ``[N, K]`` float8_e4m3fn; ``weight_scale``: N float32 scales (``[N]``,
      ``[N, 1]`` or ``[1, N]``); ``bias``: ``[N]`` or None.
    - ``config``: launch parameters; None takes :func:`default_config`.
    """
    n = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1] or weight_scale.numel() != n:
        raise ValueError(f"fp8_gemv: x [..., {x.shape[-1]}], weight {tuple(weight.shape)} and weight_scale "
                         f"{tuple(weight_scale.shape)} do not describe one [N, K] weight with N scales")
    return _gemv(x, weight, weight_scale.reshape(n).float().contiguous(), bias, config)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 16-bit ``weight`` ``[N, K]`` of x's dtype, by the same kernel."""
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1] or weight.dtype != x.dtype:
        raise ValueError(f"gemv: x [..., {x.shape[-1]}] {x.dtype} and weight {tuple(weight.shape)} {weight.dtype} "
                         "do not describe one [N, K] weight of x's dtype")
    return _gemv(x, weight, None, bias, config)


def gemv_gated(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "silu",
               config: GemvConfig | None = None) -> torch.Tensor:
    """``act(y[..., :N]) * y[..., N:]`` for ``y = F.linear(x, weight, bias)`` and a merged 16-bit ``[gate | up]``
    weight ``[2N, K]``, in one launch: each program reads the gate and the up rows of its outputs, so the product
    ``y`` is never written. ``activation``: ``silu`` or ``gelu_tanh``. Gate and up are rounded to x's dtype before
    the activation, so the result is the unfused product's and :func:`dovetail.triton.activation.act_and_mul`'s.
    ``config.block_n`` counts weight rows a program reads (half of them gate rows); None takes
    :func:`gated_config`."""
    if (weight.dim() != 2 or weight.shape[1] != x.shape[-1] or weight.dtype != x.dtype or weight.shape[0] % 2
            or activation not in GATED_ACTIVATIONS):
        raise ValueError(f"gemv_gated: x [..., {x.shape[-1]}] {x.dtype}, weight {tuple(weight.shape)} {weight.dtype} "
                         f"and activation {activation!r} do not describe one [2N, K] [gate | up] weight of x's dtype "
                         f"and one of {GATED_ACTIVATIONS}")
    return _gemv(x, weight, None, bias, config, gated=True, gelu_tanh=activation == "gelu_tanh")


#: The activations :func:`gemv_gated` applies.
GATED_ACTIVATIONS = ("silu", "gelu_tanh")


def _gemv(x, weight, scale, bias, config, gated: bool = False, gelu_tanh: bool = False):
    k = x.shape[-1]
    rows_read = weight.shape[0]
    n = rows_read // 2 if gated else rows_read
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    if config is not None:
        cfg = config
    elif gated:
        cfg = gated_config(m, rows_read, k, multiprocessor_count(x.device))
    else:
        cfg = default_config(m, rows_read, k, weight.element_size(), multiprocessor_count(x.device))
    bias_arg = bias.contiguous() if bias is not None else (scale if scale is not None else out)
    block_m = max(16, cfg.block_m) if cfg.dot else min(16, next_power_of_2(m))
    # A gated program reads block_n weight rows: half of them gate rows, the other half those outputs' up rows.
    block_n = max(16 if cfg.dot else 1, cfg.block_n // 2) if gated else cfg.block_n
    k_chunk = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    grid = (triton.cdiv(n, block_n), cfg.split_k, triton.cdiv(m, block_m))
    if cfg.split_k == 1:
        part = counts = out
    else:
        part = torch.empty((cfg.split_k, m, rows_read if gated else n), dtype=torch.float32, device=x.device)
        counts = _tile_counters(x.device, grid[0] * grid[2])
    _gemv_kernel[grid](x2, weight, out if scale is None else scale, bias_arg, out, part, counts, m, n, k,
                       x2.stride(0), weight.stride(0), out.stride(0), k_chunk, HAS_BIAS=bias is not None,
                       SPLIT_K=cfg.split_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k,
                       DOT=cfg.dot, DOT_FP32=INTERPRETED or x.dtype == torch.float32,
                       W_FP8=weight.element_size() == 1, HAS_SCALE=scale is not None, PDL_TRIGGER=cfg.pdl_trigger,
                       EVEN=n % block_n == 0 and k % cfg.block_k == 0, GATED=gated, GELU_TANH=gelu_tanh,
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs(use_pdl(x.device)))
    return out.reshape(*x.shape[:-1], n)


_counters: dict[torch.device, list[torch.Tensor]] = {}


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """int32 zeros, one per output tile, that split-K launches on ``device`` share (each leaves them at zero).

    Made on the first split-K call (the engine's warm-up, before graph capture); a larger one, when
    needed, leaves the older in place for the graphs that captured it.
    """
    held = _counters.setdefault(device, [])
    if not held or held[-1].numel() < tiles:
        held.append(torch.zeros(max(tiles, 1 << 16), dtype=torch.int32, device=device))
    return held[-1]
