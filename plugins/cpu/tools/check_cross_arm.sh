#!/bin/sh
# Cross-compiles the kernels for aarch64 (the portable path uses NEON there) and runs tools/check_kernels.cpp
# under qemu-aarch64. Needs g++-aarch64-linux-gnu and qemu-user (Debian: apt-get install g++-aarch64-linux-gnu
# qemu-user). Builds under ${TMPDIR:-/tmp}; nothing is installed.
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
out=${TMPDIR:-/tmp}/dovetail-cpu-aarch64
mkdir -p "$out"
cxx=${CXX_AARCH64:-aarch64-linux-gnu-g++}
flags="-O2 -std=c++17 -ffp-contract=off -fno-math-errno -fopenmp -I$here/csrc"
$cxx $flags -c "$here/csrc/isa_portable.cpp" -o "$out/isa_portable.o"
$cxx $flags -c "$here/csrc/dispatch.cpp" -o "$out/dispatch.o"
$cxx $flags "$here/tools/check_kernels.cpp" "$out/isa_portable.o" "$out/dispatch.o" -o "$out/check_kernels"
# The NEON intrinsics must have been used (not the plain C++ fallback).
$cxx $flags -dM -E -x c++ /dev/null | grep -q __ARM_NEON
exec qemu-aarch64 -L /usr/aarch64-linux-gnu "$out/check_kernels" portable
