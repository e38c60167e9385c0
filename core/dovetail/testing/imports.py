"""Importing a plugin must not initialise a device runtime."""

from __future__ import annotations

import subprocess
import sys

_PROGRAM = r"""
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
touched = []
torch = sys.modules.get("torch")
if torch is not None:
    if torch.cuda.is_initialized():
        touched.append("CUDA")
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and getattr(xpu, "is_initialized", lambda: False)():
        touched.append("XPU")
print(",".join(touched))
"""


def check_import_is_cheap(*modules: str) -> None:
    """Import ``modules`` in a fresh interpreter and assert no device runtime was initialised."""
    result = subprocess.run([sys.executable, "-c", _PROGRAM, *modules], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"importing {modules} failed:\n{result.stderr}"
    touched = result.stdout.strip()
    assert not touched, f"importing {', '.join(modules)} initialised the {touched} runtime"
