"""Gated activations of MLPs: ``act(x[..., :d]) * x[..., d:]`` (SiLU, or GELU with tanh)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dovetail.triton import next_power_of_2
from dovetail.triton.pdl import launch_kwargs, pdl_prologue, use_pdl


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, d, GELU_TANH: tl.constexpr, BLOCK: tl.constexpr,
                        USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * stride_out + cols, act_and_mul_rounded(gate, up, dtype, GELU_TANH).to(dtype), mask=mask)


@triton.jit
def act_and_mul_rounded(gate, up, dtype: tl.constexpr, GELU_TANH: tl.constexpr):
    """``act(gate) * up`` in float32, rounded to ``dtype`` after the activation, as the torch definition is
    (the caller rounds the product): shared with the gated GEMV, so both give the same values."""
    if GELU_TANH:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    return act.to(dtype).to(tl.float32) * up


def act_and_mul(x: torch.Tensor, gelu_tanh: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` (or ``gelu_tanh``) over ``x = [..., gate | up]``."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    block = min(1024, next_power_of_2(d))
    _act_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
        x2, out, x2.stride(0), out.stride(0), d, GELU_TANH=gelu_tanh, BLOCK=block,
        num_warps=4 if block >= 512 else 1, **launch_kwargs(use_pdl(x.device)),
    )
    return out.view(*x.shape[:-1], d)
