"""The grouped GEMMs of a mixture-of-experts layer, and the weighted sum of each token's expert outputs.

:func:`grouped_gemm` multiplies, for every block of :class:`~dovetail.triton.moe_align.AlignedPairs`,
the block's rows of ``a`` by its expert's weight ``[N, K]``; one program owns
``BLOCK_M`` pairs and ``BLOCK_N`` outputs, reads the block's expert and pairs on
the device and stops at once past ``num_padded`` (the launch covers the largest
layout the token count allows). Rows are gathered, not copied: the gate/up GEMM
reads row ``pair // top_k`` of the tokens, the down GEMM row ``pair`` of the
gate/up result; each writes row ``pair`` of its output.

- ``gated``: the weight holds ``2 * N`` rows (gate, then up); the program keeps two
  accumulators and stores ``act(gate) * up``, so SiLU-and-mul costs no pass of its own.
- FP8 (``a`` and the weight ``float8_e4m3fn``): per-row ``a`` scales with per-channel
  weight scales are applied once after the K loop; block scales per ``BLOCK_K`` step
  (``BLOCK_K`` divides the block's ``bk``).
- ``GemmConfig.tma`` (16- and 32-bit weights): the weight tiles come through a tensor descriptor (the Hopper
  tensor memory accelerator's bulk copies, where the GPU has them) instead of one address per element;
  rows past the block's expert or outputs past ``N`` only feed columns that are never stored, and the
  descriptor fills keys past ``K`` with zeros.

:func:`moe_sum` then adds each token's ``top_k`` rows in float32, weighted, in slot
order (no atomics: the result does not depend on scheduling), skipping pairs whose
expert is held by another rank.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dovetail.triton import interpreter_active, next_power_of_2
from dovetail.triton.moe_align import AlignedPairs
from dovetail.triton.pdl import launch_kwargs, pdl_prologue, use_pdl


class GemmConfig(NamedTuple):
    """Tile sizes and launch options of one grouped GEMM (``BLOCK_M`` is the alignment's ``block_m``)."""

    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False

    def as_dict(self) -> dict:
        return self._asdict()


@triton.jit
def _act(gate, GELU_TANH: tl.constexpr):
    if GELU_TANH:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        return 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
    return gate / (1.0 + tl.exp(-gate))


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _moe_gemm_kernel(
    a_ptr, b_ptr, b_desc, c_ptr, a_scale_ptr, b_scale_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    N, K, num_pairs, max_blocks,
    stride_am, stride_be, stride_bn, stride_cm, stride_asm, stride_bse, stride_bsn, stride_bsk,
    A_ROW_DIV: tl.constexpr, PAIR_PER_BLOCK: tl.constexpr, HAS_MAP: tl.constexpr, GATED: tl.constexpr, GELU_TANH: tl.constexpr, QUANT: tl.constexpr,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, B_TMA: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(max_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    if PAIR_PER_BLOCK:  # block pid_m is pair pid_m alone; sorted_ptr holds topk_ids, block_expert_ptr the map
        expert = tl.load(sorted_ptr + pid_m).to(tl.int64)
        if HAS_MAP:
            expert = tl.load(block_expert_ptr + expert).to(tl.int64)
        if expert < 0:
            return
        pairs = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs)
    else:
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    up_offset = N * stride_bn
    if B_TMA:  # the weight as [experts * rows, K]: this program's first row of it
        b_row = (expert * (2 * N if GATED else N) + pid_n * BLOCK_N).to(tl.int32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if QUANT == 2:
        a_scale_ptrs = a_scale_ptr + a_rows * stride_asm
        b_scale_ptrs = b_scale_ptr + expert * stride_bse + (offs_n // GROUP_N) * stride_bsn
        up_scale_offset = (N // GROUP_N) * stride_bsn
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if B_TMA:
            b = b_desc.load([b_row, k0]).T
            if GATED:
                b_up = b_desc.load([b_row + N, k0]).T
        elif EVEN_K:
            if EVEN_N:
                b = tl.load(b_ptrs)
            else:
                b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if GATED and not B_TMA:
            if EVEN_K:
                if EVEN_N:
                    b_up = tl.load(b_ptrs + up_offset)
                else:
                    b_up = tl.load(b_ptrs + up_offset, mask=n_ok[None, :], other=0.0)
            else:
                b_up = tl.load(b_ptrs + up_offset, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST != 0:  # 1: float32 (numpy, in the interpreter, has no bfloat16); 2: bfloat16 (no FP8 dot here)
            a = a.to(tl.float32 if UPCAST == 1 else tl.bfloat16)
            b = b.to(tl.float32 if UPCAST == 1 else tl.bfloat16)
            if GATED:
                b_up = b_up.to(tl.float32 if UPCAST == 1 else tl.bfloat16)
        if QUANT == 2:
            group = k0 // GROUP_K
            a_s = tl.load(a_scale_ptrs + group, mask=row_ok, other=0.0)
            b_s = tl.load(b_scale_ptrs + group * stride_bsk, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
            if GATED:
                b_s_up = tl.load(b_scale_ptrs + up_scale_offset + group * stride_bsk, mask=n_ok, other=0.0)
                acc_up += tl.dot(a, b_up) * a_s[:, None] * b_s_up[None, :]
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
            if GATED:
                acc_up = tl.dot(a, b_up, acc_up, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
            if GATED:
                acc_up = tl.dot(a, b_up, acc_up)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if QUANT == 1:
        a_s = tl.load(a_scale_ptr + a_rows * stride_asm, mask=row_ok, other=0.0)
        b_s = tl.load(b_scale_ptr + expert * stride_bse + offs_n * stride_bsn, mask=n_ok, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
        if GATED:
            b_s_up = tl.load(b_scale_ptr + expert * stride_bse + (offs_n + N) * stride_bsn, mask=n_ok, other=0.0)
            acc_up = acc_up * a_s[:, None] * b_s_up[None, :]
    if GATED:
        acc = _act(acc, GELU_TANH) * acc_up
    c_ptrs = c_ptr + pairs[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def reads_through_descriptor(weight: torch.Tensor) -> bool:
    """Whether ``GemmConfig.tma`` tiles can read this (unquantized) weight: contiguous, 16 or 32 bits an element,
    rows of whole 16-byte units from a 16-byte aligned start (what a tensor descriptor's address and strides
    must be)."""
    size = weight.element_size()
    return (size in (2, 4) and weight.is_contiguous() and weight.shape[-1] * size % 16 == 0
            and weight.data_ptr() % 16 == 0)


def grouped_gemm(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, aligned: AlignedPairs, config: GemmConfig,
                 a_row_div: int, gated: bool = False, gelu_tanh: bool = False, a_scale: torch.Tensor | None = None,
                 w_scale: torch.Tensor | None = None, block_size: tuple[int, int] | None = None) -> torch.Tensor:
    """``out[p] = a[p // a_row_div] @ weight[expert(p)].T`` for every aligned pair ``p`` (gated: ``act(gate) * up``).

    ``weight`` is ``[experts, N, K]`` (``[experts, 2 * N, K]`` gated) with unit stride
    over K; ``out`` ``[pairs, N]``. FP8 takes ``a_scale`` (``[rows, 1]`` or
    ``[rows, ceil(K / bk)]``) and ``w_scale`` (``[experts, N]`` or block scales).
    """
    n_out, k = out.shape[1], a.shape[1]
    quant = 0 if w_scale is None else (1 if block_size is None else 2)
    block_k = config.block_k
    group_n, group_k = block_size if block_size is not None else (1, 1)
    if quant == 2:
        block_k = min(block_k, group_k)
        if group_k % block_k or (gated and n_out % group_n):
            raise ValueError(f"FP8 block scales of {block_size} need BLOCK_K dividing {group_k} and gate/up "
                             f"halves of whole blocks (N={n_out})")
    block_n = min(config.block_n, max(16, next_power_of_2(n_out)))
    b_desc = None
    if config.tma:
        if quant or not reads_through_descriptor(weight):
            raise ValueError(f"grouped_gemm: tma tiles take contiguous 16- or 32-bit weights whose rows are whole "
                             f"16-byte units, not {weight.dtype} of shape {tuple(weight.shape)}")
        from triton.tools.tensor_descriptor import TensorDescriptor

        b_desc = TensorDescriptor.from_tensor(weight.view(-1, k), [block_n, block_k])
    grid = (aligned.max_blocks * triton.cdiv(n_out, block_n),)
    scale_strides = (0, 0, 0, 0)
    if quant:
        scale_strides = (a_scale.stride(0), w_scale.stride(0), w_scale.stride(1),
                         w_scale.stride(2) if w_scale.dim() == 3 else 0)
    _moe_gemm_kernel[grid](
        a, weight, b_desc, out, a_scale if quant else a, w_scale if quant else a,
        aligned.sorted_pairs, aligned.block_expert, aligned.num_padded,
        n_out, k, aligned.num_pairs, aligned.max_blocks,
        a.stride(0), weight.stride(0), weight.stride(1), out.stride(0), *scale_strides,
        A_ROW_DIV=a_row_div, PAIR_PER_BLOCK=aligned.pair_per_block, HAS_MAP=aligned.has_map, GATED=gated, GELU_TANH=gelu_tanh, QUANT=quant, GROUP_N=group_n, GROUP_K=group_k,
        IEEE=a.dtype == torch.float32, UPCAST=_upcast(a), BLOCK_M=aligned.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=config.group_m, EVEN_K=k % block_k == 0, EVEN_N=n_out % block_n == 0, B_TMA=config.tma,
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_kwargs(use_pdl(a.device)))
    return out


def _upcast(a: torch.Tensor) -> int:
    """How the GEMM converts its tiles before the product: 1 to float32 (bfloat16 in the interpreter), 2 to bfloat16
    (FP8 where the GPU has no FP8 tensor-core product: exact, e4m3 values being bfloat16 values), else 0."""
    if a.dtype == torch.bfloat16 and interpreter_active():
        return 1
    if a.element_size() == 1 and not interpreter_active() and not native_fp8_dot():
        return 2
    return 0


@functools.lru_cache(maxsize=None)
def native_fp8_dot() -> bool:
    """Whether triton's current GPU multiplies FP8 tiles natively (NVIDIA sm_89 and newer; elsewhere the tiles are
    converted to bfloat16 first)."""
    from triton.runtime import driver

    target = driver.active.get_current_target()
    return target.backend == "cuda" and isinstance(target.arch, int) and target.arch >= 89


@triton.jit(do_not_specialize=["num_tokens"])
def _moe_sum_kernel(c_ptr, w_ptr, ids_ptr, map_ptr, out_ptr, num_tokens, H, stride_cm, stride_om, TOP_K: tl.constexpr,
                    HAS_MAP: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        weight = tl.load(w_ptr + pair)
        mask = ok
        if HAS_MAP:
            expert = tl.load(ids_ptr + pair + offs * 0)  # a vector (masks must be): pairs held elsewhere are skipped
            mask = ok & (tl.load(map_ptr + expert) >= 0)
        row = tl.load(c_ptr + pair * stride_cm + offs, mask=mask, other=0.0)
        acc += row.to(tl.float32) * weight
    tl.store(out_ptr + token * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def moe_sum(expert_out: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor, topk_ids: torch.Tensor | None = None,
            expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * expert_out[t * top_k + j]`` in float32 (with an ``expert_map``, pairs
    whose expert it marks -1 are skipped)."""
    tokens, top_k = topk_weights.shape
    hidden = out.shape[1]
    block_h = min(1024, next_power_of_2(hidden))
    weights = topk_weights.contiguous()
    _moe_sum_kernel[(tokens, triton.cdiv(hidden, block_h))](
        expert_out, weights, topk_ids if expert_map is not None else weights,
        expert_map if expert_map is not None else weights, out, tokens, hidden,
        expert_out.stride(0), out.stride(0), TOP_K=top_k, HAS_MAP=expert_map is not None, BLOCK_H=block_h,
        num_warps=4 if block_h >= 512 else 1, **launch_kwargs(use_pdl(out.device)))
    return out
