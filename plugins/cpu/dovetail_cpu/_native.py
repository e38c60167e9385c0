"""The compiled kernel library, loaded with ctypes on first use, and its ISA dispatch.

The library (``libdovetail_cpu_kernels.so``, built when the plugin is installed) holds every kernel
once per instruction set and chooses one from the CPU's features; ``DOVETAIL_CPU_ISA`` (or
:func:`dovetail_cpu.isa.select_isa`) forces one.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch  # noqa: F401  (loads torch's OpenMP runtime first, so the kernels share its thread pool)

from dovetail.errors import ConfigError, PluginError
from dovetail_cpu import cpu_info

logger = logging.getLogger("dovetail")

LIBRARY_PATH = Path(__file__).with_name("libdovetail_cpu_kernels.so")
ISA_ENV = cpu_info.ISA_ENV

c_int, c_int32, c_int64, c_float, c_void_p, c_char_p = (ctypes.c_int, ctypes.c_int32, ctypes.c_int64,
                                                        ctypes.c_float, ctypes.c_void_p, ctypes.c_char_p)


class AttentionArgs(ctypes.Structure):
    """``dt_attention_args`` of csrc/kernels.h."""

    _fields_ = [
        ("q", c_void_p), ("k", c_void_p), ("v", c_void_p), ("out", c_void_p),
        ("key_cache", c_void_p), ("value_cache", c_void_p), ("slot_mapping", c_void_p),
        ("block_table", c_void_p), ("seq_lens", c_void_p), ("query_start_loc", c_void_p),
        ("q_stride", c_int64), ("k_stride", c_int64), ("v_stride", c_int64), ("out_stride", c_int64),
        ("block_table_stride", c_int64),
        ("num_tokens", c_int32), ("num_seqs", c_int32), ("num_heads", c_int32), ("num_kv_heads", c_int32),
        ("head_size", c_int32), ("block_size", c_int32), ("num_blocks", c_int32), ("sliding_window", c_int32),
        ("scale", c_float), ("softcap", c_float), ("dtype", c_int32), ("num_threads", c_int32),
        ("cache_dtype", c_int32),
    ]


_SIGNATURES = {
    "dt_supported_isas": ([], c_char_p),
    "dt_compiled_isas": ([], c_char_p),
    "dt_set_isa": ([c_char_p], c_int),
    "dt_current_isa": ([], c_char_p),
    "dt_has_openmp": ([], c_int),
    "dt_attention": ([ctypes.POINTER(AttentionArgs)], c_int),
    "dt_kv_cache_write": ([ctypes.POINTER(AttentionArgs)], c_int),
    "dt_rms_norm": ([c_void_p, c_int64, c_void_p, c_int32, c_void_p, c_int64, c_int64, c_int64, c_float, c_int32,
                     c_int32], None),
    "dt_add_rms_norm": ([c_void_p, c_int64, c_void_p, c_int64, c_void_p, c_int32, c_void_p, c_void_p, c_int64,
                         c_int64, c_float, c_int32, c_int32], None),
    "dt_silu_and_mul": ([c_void_p, c_int64, c_void_p, c_int64, c_int64, c_int32, c_int32], None),
    "dt_linear": ([c_void_p, c_int64, c_void_p, c_int32, c_void_p, c_void_p, c_int64, c_int64, c_int64, c_int32,
                   c_int32], None),
    "dt_rotary_neox": ([c_void_p, c_int64, c_void_p, c_int64, c_void_p, c_int64, c_void_p, c_void_p, c_void_p,
                        c_int64, c_int32, c_int32, c_int32, c_int32, c_int32, c_int32], c_int),
}

_lib: ctypes.CDLL | None = None
_current_isa: str | None = None


def missing_reason() -> str | None:
    """Why the library cannot be used here (not built), or None."""
    if not LIBRARY_PATH.is_file():
        return (f"the CPU kernels are not built ({LIBRARY_PATH} is missing): reinstall the plugin with "
                "`pip install -e plugins/cpu` (or `pip install ./plugins/cpu`), which compiles them")
    return None


def lib() -> ctypes.CDLL:
    """The loaded library, with its ISA chosen (``DOVETAIL_CPU_ISA`` or the best this CPU runs)."""
    global _lib
    if _lib is None:
        missing = missing_reason()
        if missing:
            raise PluginError(missing)
        loaded = ctypes.CDLL(str(LIBRARY_PATH))
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(loaded, name)
            fn.argtypes, fn.restype = argtypes, restype
        _lib = loaded
        requested = os.environ.get(ISA_ENV, "").strip().lower() or "auto"
        set_isa(requested, source=ISA_ENV if requested != "auto" else "auto")
    return _lib


def supported_isas() -> list[str]:
    """Paths this CPU runs, best first, less those above ``DOVETAIL_CPU_ISA`` (see :mod:`cpu_info`)."""
    return [name for name in lib().dt_supported_isas().decode().split(",") if cpu_info.allows_isa(name)]


def compiled_isas() -> list[str]:
    return lib().dt_compiled_isas().decode().split(",")


def current_isa() -> str:
    if _current_isa is None:
        lib()
    return _current_isa


def has_openmp() -> bool:
    return bool(lib().dt_has_openmp())


def set_isa(name: str, source: str = "select_isa") -> str:
    """Route every kernel through ISA ``name`` (``auto``: the best this CPU runs); returns the ISA used."""
    loaded = _lib if _lib is not None else lib()
    runs = ", ".join(supported_isas())
    ceiling = cpu_info.isa_ceiling()
    capped = f" ({ISA_ENV}={ceiling} caps it)" if ceiling else ""
    name_for_library = supported_isas()[0] if name == "auto" and ceiling else name  # the best path under the cap
    if name != "auto" and not cpu_info.allows_isa(name):
        raise ConfigError(f"{source}: this CPU cannot run the {name!r} kernels{capped}; it runs: {runs}")
    code = loaded.dt_set_isa(name_for_library.encode())
    if code == -1:
        raise ConfigError(f"{source}: unknown CPU ISA {name!r}; this build has: "
                          f"{loaded.dt_compiled_isas().decode().replace(',', ', ')} (or auto)")
    if code == -2:
        raise ConfigError(f"{source}: this CPU cannot run the {name!r} kernels; it runs: {runs}")
    global _current_isa
    chosen = _current_isa = loaded.dt_current_isa().decode()
    logger.info("cpu kernels: using the %s path (%s; this CPU runs: %s%s)", chosen,
                "forced by " + source if name != "auto" else "auto", runs, capped)
    return chosen
