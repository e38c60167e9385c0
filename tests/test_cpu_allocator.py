"""The CPU platform keeps large tensors in glibc's heap (mallopt), once, unless turned off."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = r"""
import ctypes, ctypes.util, sys, torch
libc = ctypes.CDLL(ctypes.util.find_library("c"))
if not hasattr(libc, "gnu_get_libc_version"):
    print("not-glibc"); sys.exit(0)
from dovetail_cpu import allocator
print(allocator.keep_large_allocations_in_heap(), allocator.keep_large_allocations_in_heap())
# Where a 64 MiB tensor lives: in the heap once tuned, in a mapping of its own otherwise.
t = torch.empty(64 << 20, dtype=torch.uint8)
address = t.data_ptr()
for line in open("/proc/self/maps"):
    span, *rest = line.split()
    low, high = (int(x, 16) for x in span.split("-"))
    if low <= address < high:
        print(rest[-1] if len(rest) >= 5 else "anonymous")
"""


def run(env_value: str | None):
    import os

    env = dict(os.environ)
    env.pop("DOVETAIL_CPU_MALLOC_TUNING", None)
    if env_value is not None:
        env["DOVETAIL_CPU_MALLOC_TUNING"] = env_value
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\n")


def test_mallopt_is_applied_once_and_can_be_turned_off():
    lines = run(None)
    if lines[0] == "not-glibc":
        pytest.skip("the C library is not glibc")
    assert lines[:2] == ["True True", "[heap]"]
    assert run("0")[:2] == ["False False", "anonymous"]


def test_the_cpu_platform_applies_it(tiny_llama_dir, monkeypatch):
    from dovetail import LLM
    from dovetail_cpu import allocator

    calls = []
    monkeypatch.setattr(allocator, "_done", None)
    monkeypatch.setattr(allocator, "_tune", lambda: calls.append(1) or True)
    LLM(str(tiny_llama_dir), attention_backend="REFERENCE", max_model_len=64)
    assert calls == [1]
