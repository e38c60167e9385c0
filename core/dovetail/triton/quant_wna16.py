"""Dequantise-and-multiply for packed 4/8-bit weights (GPTQ, AWQ) in Triton.

Computes :meth:`dovetail.quantization.kernels.QuantKernels.wna16_linear`: each
program owns a ``[BLOCK_M, BLOCK_N]`` tile of the output, walks K in steps of
``BLOCK_K``, unpacks the int32 words of that K range, looks up each feature's
group (``g_idx``, so act-order checkpoints need no reordering), dequantizes in
float32 and accumulates ``tl.dot`` in float32. Not tuned: one tile shape for
every problem, no split-K.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dovetail.triton import next_power_of_2


@triton.jit
def _wna16_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, out_ptr,
    M, N, K, stride_xm, stride_om,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_MODE: tl.constexpr,
):
    per_word: tl.constexpr = 32 // BITS
    value_mask: tl.constexpr = (1 << BITS) - 1
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        words = tl.load(qweight_ptr + (ks // per_word)[:, None].to(tl.int64) * N + cols[None, :], mask=w_ok, other=0)
        q = (words >> ((ks % per_word) * BITS)[:, None]) & value_mask
        group = tl.load(g_idx_ptr + ks, mask=k_ok, other=0).to(tl.int64)
        scale = tl.load(scales_ptr + group[:, None] * N + cols[None, :], mask=w_ok, other=0.0)
        zero = tl.load(zeros_ptr + group[:, None] * N + cols[None, :], mask=w_ok, other=0.0)
        w = (q.to(tl.float32) - zero) * scale
        if DOT_MODE == 1:
            acc += tl.dot(a.to(tl.float32), w, input_precision="ieee")
        elif DOT_MODE == 2:
            acc += tl.dot(a.to(tl.float32), w.to(a.dtype).to(tl.float32))
        else:
            acc += tl.dot(a, w.to(a.dtype))
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


#: Whether triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``), whose numpy has no
#: bfloat16: there a bfloat16 dot is formed from float32 products (exact, as tensor cores form them).
INTERPRETED = type(_wna16_kernel).__name__ == "InterpretedFunction"


def _dot_mode(dtype: torch.dtype) -> int:
    """0: the inputs' own dot; 1: float32 IEEE; 2: bfloat16 values multiplied in float32 (interpreter)."""
    if dtype == torch.float32:
        return 1
    return 2 if INTERPRETED and dtype == torch.bfloat16 else 0


def wna16_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        g_idx: torch.Tensor, bits: int, bias: torch.Tensor | None = None,
                        block_n: int = 64, block_k: int = 32) -> torch.Tensor:
    """``x @ W + bias`` for the packed layout of ``QuantKernels.wna16_linear``, in one kernel launch."""
    k = x.shape[-1]
    n = qweight.shape[1]
    if qweight.shape[0] * (32 // bits) != k or scales.shape != zeros.shape or scales.shape[1] != n:
        raise ValueError(f"wna16: x [..., {k}], qweight {tuple(qweight.shape)}, scales {tuple(scales.shape)} and "
                         f"zeros {tuple(zeros.shape)} do not describe one {bits}-bit [K, N] weight")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        block_m = min(64, max(16, next_power_of_2(m)))
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _wna16_kernel[grid](x2, qweight.contiguous(), scales.contiguous(), zeros.contiguous(),
                            g_idx.contiguous(), out, m, n, k, x2.stride(0), out.stride(0),
                            BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                            DOT_MODE=_dot_mode(x.dtype))
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.reshape(*x.shape[:-1], n)
