"""The kernels against the C++ harness's double-precision reference (plugins/cpu/tools/check_kernels.cpp).

Natively, the harness runs every ISA path this CPU has; with an aarch64 cross compiler and qemu-user
installed, tools/check_cross_arm.sh runs the NEON variant of the portable path under emulation.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from dovetail_cpu import _native, isa

TOOLS = Path(__file__).resolve().parents[1] / "plugins" / "cpu" / "tools"


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None or not TOOLS.is_dir():
        pytest.skip("no C++ compiler (or no plugin source tree) to build the harness")
    lib = _native.LIBRARY_PATH
    exe = tmp_path_factory.mktemp("harness") / "check_kernels"
    subprocess.run([cxx, "-O1", "-std=c++17", str(TOOLS / "check_kernels.cpp"), str(lib), "-o", str(exe),
                    f"-Wl,-rpath,{lib.parent}"], check=True, capture_output=True, text=True)
    return exe


@pytest.mark.parametrize("path", isa.ISA_NAMES)
def test_native_path_matches_double_precision(harness, path):
    if path not in isa.supported_isas():
        pytest.skip(f"this CPU lacks the {path} path; it runs: {', '.join(isa.supported_isas())}")
    result = subprocess.run([str(harness), path], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"kernels: {path}" in result.stdout


def test_neon_path_under_emulation():
    if not (shutil.which("aarch64-linux-gnu-g++") and shutil.which("qemu-aarch64")):
        pytest.skip("needs g++-aarch64-linux-gnu and qemu-user to run the NEON path (not an Arm machine)")
    result = subprocess.run(["sh", str(TOOLS / "check_cross_arm.sh")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all checks passed" in result.stdout
