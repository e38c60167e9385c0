"""Whether AMD's AITER kernels may be used, decided without importing ``aiter``.

``import aiter`` loads its JIT machinery and queries the GPU, so the checks here
only look for the package (``importlib.util.find_spec``) and read the switch
``DOVETAIL_ROCM_USE_AITER`` (default on; ``0``, ``false``, ``no`` or ``off``
turn it off).
"""

from __future__ import annotations

import importlib.util
import os

SWITCH = "DOVETAIL_ROCM_USE_AITER"
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
    from torch import version

    if not getattr(version, "hip", None):
        return "AITER needs a ROCm build of torch (torch.version.hip is not set)"
    return None
