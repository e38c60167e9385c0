"""Programmatic dependent launch (PDL) of the core's Triton kernels on Hopper and newer NVIDIA GPUs.

A kernel launched with PDL may be placed on the multiprocessors while the kernel before it on the
stream is still finishing; its programs then wait (``gdc_wait``) until that grid has completed and
its writes are visible. A decode step is hundreds of short kernels back to back, and this hides
much of the gap between them, inside CUDA graphs too.

Every PDL kernel calls :func:`pdl_prologue` in every program, before any early return and before
reading anything the kernel just before it may write: a grid that finished without waiting could
complete before its predecessor, and the kernel after it, which waits only for its own predecessor,
would then read unfinished results. What that kernel does not write is safe to read earlier (paged
attention reads the step's sequence metadata so): it lets this grid launch only after its own wait,
so every kernel before it has completed. The prologue
also lets the next kernel launch at once (``gdc_launch_dependents``): its programs do nothing but
wait until this grid has completed. A kernel for which that measured slower calls :func:`pdl_wait`
first and :func:`pdl_launch_dependents` later: the GEMV, after its main loop (one decode step's
layer linears back to back ran faster so than with the launch at its start).

On where the device's platform says it runs (``Platform.supports_pdl``); off in triton's interpreter,
with a triton without ``launch_pdl``, and with ``DOVETAIL_TRITON_PDL=0`` (read once per device, at its
first launch).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    """Wait for the previous grid on the stream, then let the next one launch (no-op unless ``USE_PDL``)."""
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the previous grid on the stream has completed and its writes are visible."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_launch_dependents(USE_PDL: tl.constexpr):
    """Let the next grid on the stream launch once every program of this one has called this or exited."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def _triton_supports_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        import triton.language.extra.cuda as cuda_extra
    except Exception:
        return False
    return (any(f.name == "launch_pdl" for f in dataclasses.fields(CUDAOptions))
            and hasattr(cuda_extra, "gdc_wait"))


def use_pdl(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` use programmatic dependent launch (decided once per device)."""
    return device.type != "cpu" and _use_pdl_on(device.type, device.index)


@functools.lru_cache(maxsize=None)
def _use_pdl_on(device_type: str, index: int | None) -> bool:
    if os.environ.get("DOVETAIL_TRITON_PDL", "1") == "0":
        return False
    from dovetail.triton import interpreter_active

    if interpreter_active() or not _triton_supports_pdl():
        return False
    from dovetail.selection import platform_for_device

    platform = platform_for_device(device_type)
    return platform is not None and platform.supports_pdl(index)


def launch_kwargs(pdl: bool) -> dict:
    """A kernel's ``USE_PDL`` and the matching launch option, as keyword arguments of its launch: the two must agree
    (a PDL launch whose programs do not wait would race its predecessor)."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl else {"USE_PDL": False}
