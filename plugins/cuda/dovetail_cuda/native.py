"""The CUDA plugin's own CUDA C++ kernels, compiled with nvcc on first use and called through ctypes.

The sources are in ``dovetail_cuda/csrc``. :func:`library` compiles them for the current GPU's
architecture into ``$DOVETAIL_CACHE_DIR/cuda`` (default ``~/.cache/dovetail/cuda``), once per
source, architecture and nvcc, and loads the shared library. Its entry points take raw device
pointers and launch on the caller's stream, so CUDA graph capture records them like any torch
kernel. Where nvcc is missing or the build fails, :func:`library` returns None and says why once
(:func:`unavailable_reason`); callers then take their Triton path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger("dovetail")

SOURCES = Path(__file__).resolve().parent / "csrc"


def nvcc_path() -> str | None:
    """nvcc from ``$CUDA_HOME/bin``, ``$PATH`` or ``/usr/local/cuda/bin``."""
    candidates = [Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc"] if os.environ.get("CUDA_HOME") else []
    found = shutil.which("nvcc")
    candidates += [Path(found)] if found else []
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    return next((str(c) for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)


def arch_flag(capability: tuple[int, int]) -> str:
    """nvcc's ``-arch`` for a compute capability; Hopper's ``a`` variant for the ``griddepcontrol`` PTX."""
    major, minor = capability
    return f"sm_{major}{minor}a" if major == 9 else f"sm_{major}{minor}"


def _cache_dir() -> Path:
    root = os.environ.get("DOVETAIL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "dovetail")
    return Path(root) / "cuda"


def build(source: str, capability: tuple[int, int], nvcc: str) -> Path:
    """Compile ``csrc/<source>`` into a shared library (cached by source text, arch and nvcc) and return its path."""
    text = (SOURCES / source).read_bytes()
    arch = arch_flag(capability)
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(text + arch.encode() + version.encode()).hexdigest()[:16]
    target = _cache_dir() / f"{Path(source).stem}-{arch}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        command = [nvcc, "-O3", "-std=c++17", f"-arch={arch}", "-shared", "-Xcompiler", "-fPIC",
                   "-cudart", "shared", "-o", str(partial), str(SOURCES / source)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed on {source} ({' '.join(command)}):\n{done.stderr[-2000:]}")
        os.replace(partial, target)  # atomic: a concurrent build of the same key writes the same bytes
    return target


@functools.lru_cache(maxsize=None)
def _load(source: str, capability: tuple[int, int]) -> tuple[ctypes.CDLL | None, str | None]:
    nvcc = nvcc_path()
    if nvcc is None:
        return None, "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    try:
        return ctypes.CDLL(str(build(source, capability, nvcc))), None
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


def library(source: str, device: torch.device | int | None = None) -> ctypes.CDLL | None:
    """The loaded library of ``csrc/<source>`` for ``device``'s architecture, or None (logged once)."""
    capability = torch.cuda.get_device_capability(device)
    lib, reason = _load(source, capability)
    if lib is None:
        _warn_once(source, reason)
    return lib


def unavailable_reason(source: str, device: torch.device | int | None = None) -> str | None:
    """Why :func:`library` gives None for ``source`` on ``device``; None when it loads."""
    return _load(source, torch.cuda.get_device_capability(device))[1]


@functools.lru_cache(maxsize=None)
def _warn_once(source: str, reason: str) -> None:
    logger.warning("CUDA kernels of %s unavailable, using the Triton path: %s", source, reason)
