"""What this CPU offers, read from /proc/cpuinfo (no torch import).

``DOVETAIL_CPU_ISA=avx512|avx2|portable`` makes the process behave as on a CPU whose best
kernel path is that one: the flags of the paths above it are hidden here, so bfloat16 is
offered, the probe reports and the kernel paths are chosen exactly as on such a CPU. That is
how the test suite proves on an AVX-512 machine that it passes on AVX2-only and other CPUs.
"""

from __future__ import annotations

import os
import platform as _platform
from functools import lru_cache

from dovetail.platform import ProbeResult

ISA_ENV = "DOVETAIL_CPU_ISA"
#: The kernel paths, best first.
ISA_ORDER = ("avx512_bf16", "avx512", "avx2", "portable")

#: x86 flags a CPU whose best path is the key lacks (every flag of the paths above it).
_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "amx_int8", "amx_fp16", "amx_complex")
_VNNI_FLAGS = ("avx_vnni", "avx_vnni_int8", "avx_ne_convert", "avx_ifma")
_AVX2_FLAGS = ("avx", "avx2", "fma", "f16c", *_VNNI_FLAGS)


def _hidden(flag: str, ceiling: str) -> bool:
    if ceiling == "avx512":
        return flag in _BF16_FLAGS
    if ceiling == "avx2":  # the plainest AVX2 CPU: no VNNI either (Haswell to Zen 3)
        return flag.startswith(("avx512", "amx")) or flag in _VNNI_FLAGS
    if ceiling == "portable":
        return flag.startswith(("avx512", "amx")) or flag in _AVX2_FLAGS
    return False


def isa_ceiling() -> str | None:
    """The path ``DOVETAIL_CPU_ISA`` caps this process at, or None (``auto`` or unset)."""
    value = os.environ.get(ISA_ENV, "").strip().lower()
    return value if value in ISA_ORDER else None


@lru_cache(maxsize=1)
def _proc_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, less those of paths above ``DOVETAIL_CPU_ISA``."""
    flags = _proc_flags()
    ceiling = isa_ceiling()
    if ceiling is None:
        return flags
    return frozenset(f for f in flags if not _hidden(f, ceiling))


def allows_isa(name: str) -> bool:
    """Whether ``DOVETAIL_CPU_ISA`` leaves kernel path ``name`` to this process."""
    ceiling = isa_ceiling()
    if ceiling is None or name not in ISA_ORDER:
        return True
    return ISA_ORDER.index(name) >= ISA_ORDER.index(ceiling)


def has_bf16() -> bool:
    """Whether the CPU computes bf16 natively (AVX-512 BF16, AMX, or Arm BF16)."""
    flags = cpu_flags()
    return bool({"avx512_bf16", "amx_bf16", "bf16"} & flags)


def has_int8_dot_product() -> bool:
    """Whether the CPU multiplies int8 vectors into int32 sums (x86 VNNI or AMX-INT8)."""
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags())


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def probe() -> ProbeResult:
    flags = cpu_flags()
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else _platform.machine()
    forced = f", capped at {isa_ceiling()} by {ISA_ENV}" if isa_ceiling() else ""
    return ProbeResult.ok(f"{usable_cores()} cores, {isa}{', bf16' if has_bf16() else ''}{forced}")
