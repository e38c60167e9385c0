"""Which instruction set the CPU kernels use, and forcing one (tests, benchmarks, bug reports).

``DOVETAIL_CPU_ISA=avx512_bf16|avx512|avx2|portable`` in the environment forces a path for the
process and makes it behave as on a CPU whose best path that is (no bfloat16 below
``avx512_bf16``, no faster path to select; see :mod:`dovetail_cpu.cpu_info`); :func:`select_isa`
chooses among the paths left, from Python. The default (``auto``) is the best path
this CPU runs: AVX-512 with the BF16 dot products, then AVX-512, AVX2 with FMA, then the portable
path (NEON on Arm, plain C++ elsewhere).
"""

from __future__ import annotations

from dovetail_cpu import _native

ISA_NAMES = ("avx512_bf16", "avx512", "avx2", "portable")


def selected_isa() -> str:
    """The path every kernel call goes through now."""
    return _native.current_isa()


def supported_isas() -> list[str]:
    """Paths this CPU can run (and this build contains), best first."""
    return _native.supported_isas()


def compiled_isas() -> list[str]:
    """Paths compiled into the installed library."""
    return _native.compiled_isas()


def select_isa(name: str = "auto") -> str:
    """Force path ``name`` (``auto``: the best supported); returns the path now in use.

    Raises :class:`dovetail.errors.ConfigError` for an unknown name or one this CPU cannot run.
    """
    return _native.set_isa(name.strip().lower())
