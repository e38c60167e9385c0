"""Keep large tensors in the heap: glibc otherwise maps and unmaps every block above 32 MiB.

A prefill step of a few thousand tokens makes activations of tens of megabytes (5,120 tokens of
the C1 model's gate/up projection: 56 MB). glibc serves those with a fresh ``mmap`` each time and
returns them on ``free``, so each one is page-faulted in again, 4 KiB at a time. Raising the mmap
threshold and the trim threshold keeps them in the heap, reused from step to step (C1 throughput
rose in alternating runs of ``benchmarks/cpu_c1c2.py`` with ``DOVETAIL_CPU_MALLOC_TUNING`` 0 and 1:
benchmarks/RESULTS.md); the price is that the process keeps its peak heap instead of giving
it back to the system. vLLM's CPU backend gets the same from tcmalloc through ``LD_PRELOAD``.
``DOVETAIL_CPU_MALLOC_TUNING=0`` leaves glibc alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger("dovetail")

ENV = "DOVETAIL_CPU_MALLOC_TUNING"
#: mallopt parameters of glibc's malloc.h.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1

_done: bool | None = None


def keep_large_allocations_in_heap() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; False where that is not glibc or is turned off."""
    global _done
    if _done is None:
        _done = _tune()
    return _done


def _tune() -> bool:
    if os.environ.get(ENV, "1").strip() == "0":
        logger.info("cpu: %s=0, the allocator's thresholds are left alone", ENV)
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None) if libc is not None else None
        gnu = getattr(libc, "gnu_get_libc_version", None) if libc is not None else None
    except OSError:
        return False
    if mallopt is None or gnu is None:  # not glibc (musl, macOS): nothing to tune here
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    logger.info("cpu: glibc keeps blocks up to %d MiB in the heap%s", MMAP_THRESHOLD >> 20, "" if ok else " (refused)")
    return ok
