"""Whether AMD's AITER kernels may be used, decided without importing ``aiter``.

``import aiter`` loads its JIT machinery and queries the GPU, so the checks here
only look for the package (``importlib.util.find_spec``), read the switch
``DOVETAIL_ROCM_USE_AITER`` (default on; ``0``, ``false``, ``no`` or ``off``
turn it off) and compare the visible GPUs' targets (from sysfs, see
:mod:`dovetail_rocm.probe`) with those aiter's decode kernel is built for.
"""

from __future__ import annotations

import importlib.util
import os

SWITCH = "DOVETAIL_ROCM_USE_AITER"
#: The GPU targets aiter's paged-decode kernel is compiled for (csrc/cpp_itfs/pa/pa_v1.cuh guards it with
#: ``__gfx90a__ || __gfx942__ || __gfx950__``; other targets, RDNA included, get no kernel).
AITER_DECODE_ARCHS = ("gfx90a", "gfx942", "gfx950")
_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on", "")


def aiter_switch_on() -> bool:
    """The value of ``DOVETAIL_ROCM_USE_AITER``; an unrecognised value is an error naming the variable."""
    raw = os.environ.get(SWITCH, "1").strip().lower()
    if raw in _OFF:
        return False
    if raw in _ON:
        return True
    from dovetail.errors import ConfigError

    raise ConfigError(f"{SWITCH}={os.environ[SWITCH]!r} is not a switch value; use 1 or 0")


def aiter_unavailable_reason() -> str | None:
    """Why the AITER backend cannot be used here (switched off, package missing, not a ROCm torch), or None."""
    if not aiter_switch_on():
        return f"AITER is switched off by {SWITCH}={os.environ[SWITCH]!r}"
    if importlib.util.find_spec("aiter") is None:
        return "the aiter package is not installed (see the dovetail-rocm README for installing AMD's AITER)"
    if os.environ.get("AITER_TRITON_ONLY", "0") == "1":
        return "aiter is in Triton-only mode (AITER_TRITON_ONLY=1), which leaves out paged_attention_v1"
    from torch import version

    if not getattr(version, "hip", None):
        return "AITER needs a ROCm build of torch (torch.version.hip is not set)"
    from dovetail_rocm.probe import find_devices

    others = sorted({g.gfx_arch for g in find_devices().visible} - set(AITER_DECODE_ARCHS))
    if others:
        return (f"aiter's paged-decode kernel is built for {', '.join(AITER_DECODE_ARCHS)} only "
                f"(this machine has {', '.join(others)})")
    return None
