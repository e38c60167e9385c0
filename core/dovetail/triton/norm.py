"""RMSNorm, optionally fused with the residual add, one row per program.

Rows may be the heads of strided token rows (``[tokens, heads, head_size]`` views of a merged
QKV output, for per-head q/k norms): row ``r`` starts at ``(r // heads) * stride_token +
(r % heads) * stride_x``, so no copy gathers them first.

With ``pair_weights`` (``[tokens, top_k]``) row ``t`` of the input is the weighted sum of rows
``t * top_k + j`` of a mixture of experts' pair outputs, rounded to the input's dtype as the experts'
sum kernel rounds it: the norm after an MoE layer sums the experts in its own launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dovetail.triton import next_power_of_2
from dovetail.triton.pdl import launch_kwargs, pdl_prologue, use_pdl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, summed_ptr, pair_weights_ptr,
    stride_x, stride_residual, stride_out, stride_summed, hidden, eps, heads, stride_token,
    HAS_RESIDUAL: tl.constexpr, WEIGHT_FP32: tl.constexpr, BLOCK: tl.constexpr, HEADS: tl.constexpr,
    TOP_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    # Arithmetic in float32, rounded where the torch definition rounds (as torch's opmath does).
    dtype = out_ptr.dtype.element_ty
    pid = tl.program_id(0)
    row = pid.to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    if TOP_K > 0:  # the experts' weighted sum, rounded as their sum kernel rounds it
        x = tl.zeros([BLOCK], tl.float32)
        for j in tl.static_range(TOP_K):
            pair = row * TOP_K + j
            x += tl.load(x_ptr + pair * stride_x + cols, mask=mask, other=0.0).to(tl.float32) * tl.load(
                pair_weights_ptr + pair)
        x = x.to(dtype).to(tl.float32)
    else:
        if HEADS:  # 32-bit division: a 64-bit one sits on the load's critical path
            x_row = (pid // heads).to(tl.int64) * stride_token + (pid % heads).to(tl.int64) * stride_x
        else:
            x_row = row * stride_x
        x = tl.load(x_ptr + x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + residual).to(dtype)
        tl.store(summed_ptr + row * stride_summed + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / hidden + eps)
    normed = x * rstd
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if WEIGHT_FP32:
        y = normed * weight
    else:
        y = normed.to(dtype).to(tl.float32) * weight
    tl.store(out_ptr + row * stride_out + cols, y.to(dtype), mask=mask)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel covers these inputs (else the caller uses the torch definition)."""
    return (x.numel() > 0 and x.shape[-1] <= 65536 and weight.dim() == 1 and weight.shape[0] == x.shape[-1]
            and weight.dtype in (torch.float32, x.dtype) and weight.is_contiguous())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             pair_weights: torch.Tensor | None = None):
    """``rms_norm(x [+ residual]) * weight``; with a residual, returns ``(normed, x + residual)``. With
    ``pair_weights`` (float32 ``[tokens, top_k]``) ``x`` is ``[tokens * top_k, hidden]`` and its weighted sum
    per token takes its place (module docstring); the outputs then have ``tokens`` rows."""
    hidden = x.shape[-1]
    strided_heads = (x.dim() == 3 and x.shape[0] > 1 and x.shape[1] > 1 and x.stride(-1) == 1
                     and x.stride(0) != x.shape[1] * x.stride(1))
    if residual is None and strided_heads and pair_weights is None:
        heads, stride_token, x2 = x.shape[1], x.stride(0), x[:, 0]  # heads of strided token rows, read in place
        rows, stride_row = x.shape[0] * heads, x.stride(1)
    else:
        x2 = x.reshape(-1, hidden)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        heads, stride_token, rows, stride_row = 1, x2.stride(0), x2.shape[0], x2.stride(0)
    top_k, shape = 0, x.shape
    if pair_weights is not None:  # one output row per token, from its top_k pair rows
        (rows, top_k), pair_weights = pair_weights.shape, pair_weights.contiguous()
        shape = (rows, hidden)
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        summed = torch.empty_like(out)
    else:
        r2, summed = x2, out
    block = next_power_of_2(hidden)
    _rms_norm_kernel[(rows,)](
        x2, r2, weight, out, summed, pair_weights if top_k else weight, stride_row, r2.stride(0), out.stride(0),
        summed.stride(0), hidden, float(eps), heads, stride_token,
        HAS_RESIDUAL=residual is not None, WEIGHT_FP32=weight.dtype == torch.float32,
        BLOCK=block, HEADS=heads > 1, TOP_K=top_k, num_warps=min(16, max(1, block // 512)),
        **launch_kwargs(use_pdl(x.device)),
    )
    if residual is None:
        return out.view(shape)
    return out.view(shape), summed.view(shape)
