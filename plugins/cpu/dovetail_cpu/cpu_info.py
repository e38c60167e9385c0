"""What this CPU offers, read from /proc/cpuinfo (no torch import)."""

from __future__ import annotations

import os
import platform as _platform
from functools import lru_cache

from dovetail.platform import ProbeResult


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_bf16() -> bool:
    """Whether the CPU computes bf16 natively (AVX-512 BF16, AMX, or Arm BF16)."""
    flags = cpu_flags()
    return bool({"avx512_bf16", "amx_bf16", "bf16"} & flags)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def probe() -> ProbeResult:
    isa = "avx512" if "avx512f" in cpu_flags() else "avx2" if "avx2" in cpu_flags() else _platform.machine()
    return ProbeResult.ok(f"{usable_cores()} cores, {isa}{', bf16' if has_bf16() else ''}")
