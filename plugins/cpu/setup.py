"""Builds the CPU kernels into a plain shared library (C ABI, no torch headers) when the plugin is installed.

Each instruction set is compiled in its own translation unit with its own flags (csrc/isa_*.cpp); the
library picks one at run time (csrc/dispatch.cpp). Nothing is compiled or downloaded at run time.

Environment: ``CXX`` chooses the compiler (default: the first of c++, g++, clang++ that works);
``DOVETAIL_CPU_CXXFLAGS`` adds flags to every compile.
"""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
LIBRARY = "dovetail_cpu.libdovetail_cpu_kernels"
BASE_FLAGS = ["-O3", "-fPIC", "-std=c++17", "-fvisibility=hidden", "-ffp-contract=off", "-fno-math-errno"]
AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mavx2", "-mf16c"]
# (source, flags, macro telling dispatch.cpp that the unit was built), for x86-64.
X86_UNITS = [
    ("isa_avx512_bf16.cpp", AVX512 + ["-mavx512bf16"], "DT_WITH_AVX512_BF16"),
    ("isa_avx512.cpp", AVX512, "DT_WITH_AVX512"),
    ("isa_avx2.cpp", ["-mavx2", "-mfma", "-mf16c"], "DT_WITH_AVX2"),
]
NO_COMPILER = (
    "dovetail-cpu compiles its kernels at install time and needs a C++17 compiler, but none was found "
    "(tried: {tried}). Install one (Debian/Ubuntu: `apt-get install g++`; Fedora: `dnf install gcc-c++`; "
    "macOS: `xcode-select --install`) or name it with the CXX environment variable, then reinstall."
)


def _run(cmd: list[str], cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _compiles(cxx: list[str], flags: list[str], code: str = "int main() { return 0; }\n", link: bool = False) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.cpp")
        Path(src).write_text(code)
        out = os.path.join(tmp, "probe" + ("" if link else ".o"))
        cmd = [*cxx, *flags, src, "-o", out] if link else [*cxx, *flags, "-c", src, "-o", out]
        try:
            return _run(cmd).returncode == 0
        except OSError:
            return False


def find_compiler() -> list[str]:
    candidates = []
    if os.environ.get("CXX"):
        candidates.append(os.environ["CXX"])
    configured = sysconfig.get_config_var("CXX")
    if configured:
        candidates.append(configured)
    candidates += ["c++", "g++", "clang++"]
    tried = []
    for candidate in candidates:
        cmd = shlex.split(candidate)
        if not cmd or cmd in tried:
            continue
        tried.append(cmd)
        if shutil.which(cmd[0]) and _compiles(cmd, ["-std=c++17"]):
            return cmd
    raise RuntimeError(NO_COMPILER.format(tried=", ".join(" ".join(c) for c in tried)))


class BuildKernels(build_ext):
    """Compiles csrc/ into dovetail_cpu/libdovetail_cpu_kernels.so with the system C++ compiler."""

    def get_ext_filename(self, fullname: str) -> str:
        return os.path.join(*fullname.split(".")) + ".so"

    def build_extension(self, ext: Extension) -> None:
        cxx = find_compiler()
        extra = shlex.split(os.environ.get("DOVETAIL_CPU_CXXFLAGS", ""))
        flags = BASE_FLAGS + extra
        temp = Path(self.build_temp) / "dovetail_cpu_kernels"
        temp.mkdir(parents=True, exist_ok=True)
        units = [("isa_portable.cpp", [], None)]
        if platform.machine().lower() in ("x86_64", "amd64", "i686", "i386"):
            units = X86_UNITS + units
        objects, macros = [], []
        for source, isa_flags, macro in units:
            if isa_flags and not _compiles(cxx, flags + isa_flags):
                self.warn(f"{cxx[0]} does not accept {' '.join(isa_flags)}: the {source[4:-4]} kernels are "
                          "not built (a newer compiler would add them)")
                continue
            objects.append(self._compile(cxx, flags + isa_flags, CSRC / source, temp))
            if macro:
                macros.append(f"-D{macro}")
        openmp = ["-fopenmp"] if _compiles(cxx, ["-fopenmp"], "#include <omp.h>\nint main() { return omp_get_max_threads(); }\n",
                                           link=True) else []
        if not openmp:
            self.warn(f"{cxx[0]} has no OpenMP: the kernels will start std::threads on every parallel call")
        objects.append(self._compile(cxx, flags + openmp + macros, CSRC / "dispatch.cpp", temp))
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        link = [*cxx, "-shared", *objects, "-o", str(target), *openmp, *extra]
        if sys.platform == "darwin":
            link.insert(2, "-undefined")
            link.insert(3, "dynamic_lookup")
        self._check(link)

    def _compile(self, cxx: list[str], flags: list[str], source: Path, temp: Path) -> str:
        obj = str(temp / (source.stem + ".o"))
        self._check([*cxx, *flags, f"-I{CSRC}", "-c", str(source), "-o", obj])
        return obj

    def _check(self, cmd: list[str]) -> None:
        self.announce(" ".join(cmd), level=2)
        result = _run(cmd)
        if result.returncode != 0:
            raise RuntimeError(f"building the dovetail-cpu kernels failed:\n$ {' '.join(cmd)}\n{result.stdout}")


class AnyPythonWheel(bdist_wheel):
    """The library is called through ctypes, not Python's C API: one wheel per platform serves every Python 3."""

    def get_tag(self):
        return ("py3", "none", super().get_tag()[2])


setup(
    ext_modules=[Extension(LIBRARY, sources=[str(p.relative_to(HERE)) for p in sorted(CSRC.glob("*.cpp"))])],
    cmdclass={"build_ext": BuildKernels, "bdist_wheel": AnyPythonWheel},
)
