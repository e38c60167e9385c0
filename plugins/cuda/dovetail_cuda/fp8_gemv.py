"""Weight-only FP8 GEMV for one token in CUDA C++ (``csrc/fp8_gemv.cu``), for Hopper's decode steps.

:func:`fp8_gemv` computes ``x @ (weight * scale[:, None]).T + bias`` for one row of bfloat16 or
float16 ``x`` and an e4m3 ``weight [N, K]``, like :func:`dovetail.triton.gemv.fp8_gemv`, whose
result it equals up to float32 summation order; with ``gated=True`` it also applies SiLU-and-mul
to the two halves of that product (an MLP's merged gate/up projection) before rounding. Each warp
streams whole weight rows (or a share of their K, summed in the block), and the weight loads are
issued before the kernel waits for its predecessor (programmatic dependent launch, as
:mod:`dovetail.triton.pdl` decides).
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from dovetail_cuda import native

SOURCE = "fp8_gemv.cu"
_DTYPES = {torch.bfloat16: 0, torch.float16: 1}


class NativeGemvConfig(NamedTuple):
    """Launch parameters: outputs a warp group owns (1 or 2), 512-byte K steps loaded at a time (1 or 2), when the
    next kernel may launch (0: at completion, 2: after the main loop, 3: once the last loads are issued), warps a
    block (1, 2, 4, 8 or 16), and warps a group (1 or 2, dividing ``warps``), which share its outputs' K."""

    rows: int = 1
    unroll: int = 2
    trigger: int = 2
    warps: int = 4
    split: int = 1


#: The values each field of :class:`NativeGemvConfig` may take (the instantiations ``csrc/fp8_gemv.cu`` compiles).
CHOICES = {"rows": (1, 2), "unroll": (1, 2), "trigger": (0, 2, 3), "warps": (1, 2, 4, 8, 16), "split": (1, 2)}

#: The gated launch (gate/up with SiLU-and-mul; each output reads two weight rows): one output a warp, one K step
#: at a time, the next kernel launched once the last loads are out: the fastest of the gated configurations in
#: llama-3.1-8b's fp8 batch-1 decode (benchmarks/RESULTS.md).
GATED_DEFAULT = NativeGemvConfig(1, 1, 3, 4)

#: Plain GEMVs with few outputs for the GPU (fewer than :data:`SHARED_K_BELOW` warps a multiprocessor) and long rows
#: (K of :data:`SHARED_K_MIN_K` or more): two warps share each output's K, in blocks of 8 warps, one K step at a
#: time, the next kernel launched once the last loads are out. It made llama-3.1-8b's o and down projections and
#: fp8 batch-1 decode faster, and qwen3-0.6b's (K 1,024-3,072) slower, hence the bound on K (benchmarks/RESULTS.md).
SHARED_K_DEFAULT = NativeGemvConfig(1, 1, 3, 8, 2)
SHARED_K_BELOW = 40
SHARED_K_MIN_K = 4096


def default_config(gated: bool = False, outputs: int | None = None, multiprocessors: int | None = None,
                   k: int | None = None) -> NativeGemvConfig:
    """:data:`GATED_DEFAULT`; :data:`SHARED_K_DEFAULT` for fewer ``outputs`` than :data:`SHARED_K_BELOW` warps on each
    of the GPU's ``multiprocessors`` and ``k`` of at least :data:`SHARED_K_MIN_K`; else one warp an output, two K
    steps at a time."""
    if gated:
        return GATED_DEFAULT
    if (outputs is not None and multiprocessors and k is not None and outputs < SHARED_K_BELOW * multiprocessors
            and k >= SHARED_K_MIN_K):
        return SHARED_K_DEFAULT
    return NativeGemvConfig()


def supports(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
             gated: bool = False) -> bool:
    """Whether :func:`fp8_gemv` takes these operands: one contiguous 16-bit row on a CUDA device, an e4m3
    ``[N, K]`` weight with unit stride over K, K and the row stride multiples of 16, 16-byte aligned data
    (and N even when ``gated``)."""
    k = x.shape[-1]
    return (x.is_cuda and x.dtype in _DTYPES and x.numel() == k and x.is_contiguous()
            and weight.dim() == 2 and not (gated and weight.shape[0] % 2) and weight.dtype == torch.float8_e4m3fn
            and weight.shape[1] == k
            and weight.stride(1) == 1 and weight.stride(0) % 16 == 0 and k % 16 == 0 and k > 0
            and weight.data_ptr() % 16 == 0 and x.data_ptr() % 16 == 0
            and weight_scale.numel() == weight.shape[0] and (bias is None or bias.numel() == weight.shape[0]))


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
             config: NativeGemvConfig | None = None, pdl: bool | None = None, gated: bool = False) -> torch.Tensor:
    """``x @ (weight.float() * weight_scale[:, None]).T + bias`` in x's dtype, for operands :func:`supports` takes;
    with ``gated``, ``silu(y[..., :N/2]) * y[..., N/2:]`` of that product ``y`` (computed in float32).

    Raises ValueError for other operands and RuntimeError when the kernel library is unavailable or
    the launch fails. ``pdl`` None follows :func:`dovetail.triton.pdl.use_pdl`.
    """
    if not supports(x, weight, weight_scale, bias, gated):
        raise ValueError(f"fp8_gemv (CUDA): unsupported operands x {tuple(x.shape)} {x.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype} stride {weight.stride()}")
    lib = native.library(SOURCE, x.device)
    if lib is None:
        raise RuntimeError(f"fp8_gemv (CUDA): {native.unavailable_reason(SOURCE, x.device)}")
    if pdl is None:
        from dovetail.triton.pdl import use_pdl

        pdl = use_pdl(x.device)
    return launch(lib, x, weight, weight_scale, bias, config or default_config(gated), pdl, gated)


def launch(lib, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
           cfg: NativeGemvConfig, pdl: bool, gated: bool) -> torch.Tensor:
    """:func:`fp8_gemv` for operands already checked by :func:`supports`, with the loaded library ``lib``."""
    n, k = weight.shape
    scale = weight_scale.reshape(n)
    if scale.dtype != torch.float32 or not scale.is_contiguous():
        scale = scale.float().contiguous()
    if bias is not None:
        bias = bias.reshape(n).to(x.dtype).contiguous()
    outputs = n // 2 if gated else n
    out = torch.empty((*x.shape[:-1], outputs), dtype=x.dtype, device=x.device)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    err = lib.dovetail_fp8_gemv(
        ctypes.c_void_p(weight.data_ptr()), ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(scale.data_ptr()),
        ctypes.c_void_p(bias.data_ptr() if bias is not None else None), ctypes.c_void_p(out.data_ptr()),
        ctypes.c_int(outputs), ctypes.c_int(k), ctypes.c_longlong(weight.stride(0)), ctypes.c_int(_DTYPES[x.dtype]),
        ctypes.c_int(cfg.rows), ctypes.c_int(cfg.unroll), ctypes.c_int(cfg.trigger), ctypes.c_int(int(gated)),
        ctypes.c_int(cfg.warps), ctypes.c_int(cfg.split), ctypes.c_int(int(pdl)), ctypes.c_void_p(stream))
    if err != 0:
        raise RuntimeError(f"fp8_gemv (CUDA): launch failed with {'no such config' if err == -1 else f'cudaError {err}'}"
                           f" for {cfg}")
    return out
