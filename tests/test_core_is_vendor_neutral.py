"""The core asks its Platform about the hardware; it never calls a vendor's runtime itself.

Every module of ``core/dovetail`` is parsed, and any use of a vendor's torch runtime in code (not in docstrings
or comments) fails the test: ``torch.cuda``, ``torch.xpu``, ``torch.mps``, ``torch.version.hip`` /
``torch.version.cuda``, ``torch.backends.cuda`` / ``cudnn``, imports of them, and ``get_device_capability``
by any path. Such a question belongs to a ``Platform`` method (``multiprocessor_count``, ``supports_pdl``,
``capture_graph``, ...) or to the platform's ``FusedOps`` / ``QuantKernels``, which plugins answer.
``TorchDevicePlatform`` reaches the runtime as ``torch.<device_type>``, named by the plugin's platform.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dovetail

CORE = Path(dovetail.__file__).resolve().parent
VENDOR_MODULES = ("torch.cuda", "torch.xpu", "torch.mps", "torch.version.hip", "torch.version.cuda",
                  "torch.backends.cuda", "torch.backends.cudnn")
VENDOR_ATTRIBUTES = ("get_device_capability",)


def dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attribute accesses on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def is_vendor(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in VENDOR_MODULES)


def vendor_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) of every vendor runtime use in ``source``'s code."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            name = dotted(node)
            if (name and is_vendor(name)) or node.attr in VENDOR_ATTRIBUTES:
                found.append((node.lineno, name or node.attr))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if is_vendor(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
            found += [(node.lineno, n) for n in [node.module, *names] if is_vendor(n)]
    return sorted(set(found))


def test_the_check_finds_vendor_calls_and_ignores_docstrings():
    source = '''
"""Uses torch.cuda.synchronize() in prose only."""
import torch
import torch.cuda
from torch import xpu
from torch.backends.cuda import matmul
x = torch.cuda.get_device_properties(0).multi_processor_count
y = torch.version.hip is None
z = runtime.get_device_capability(0)
ok = torch.accelerator.synchronize()
'''
    assert vendor_uses(source) == [
        (4, "torch.cuda"), (5, "torch.xpu"), (6, "torch.backends.cuda"), (6, "torch.backends.cuda.matmul"),
        (7, "torch.cuda"), (7, "torch.cuda.get_device_properties"), (8, "torch.version.hip"),
        (9, "runtime.get_device_capability")]


def test_no_core_module_calls_a_vendor_runtime():
    offenders = []
    for path in sorted(CORE.rglob("*.py")):
        for line, what in vendor_uses(path.read_text()):
            offenders.append(f"{path.relative_to(CORE.parent)}:{line}: {what}")
    assert not offenders, "vendor runtime calls in the core (ask the Platform instead):\n" + "\n".join(offenders)


class _FakeGpu:
    """What a plugin's platform answers about its device (only the questions the kernels ask)."""

    device_type = "meta"

    def __init__(self, multiprocessors: int, pdl: bool):
        self.multiprocessors, self.pdl, self.asked = multiprocessors, pdl, []

    def multiprocessor_count(self, index=None) -> int:
        self.asked.append(("multiprocessor_count", index))
        return self.multiprocessors

    def supports_pdl(self, index=None) -> bool:
        self.asked.append(("supports_pdl", index))
        return self.pdl


def test_the_triton_kernels_ask_the_platform_of_the_device(monkeypatch):
    import os

    import torch

    if not torch.cuda.is_available():  # as the kernel tests: before triton is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import pytest

    pytest.importorskip("triton")
    import dovetail.triton
    from dovetail import selection
    from dovetail.triton import paged_attention, pdl
    from dovetail.triton import multiprocessors as unit_counts

    monkeypatch.setattr(dovetail.triton, "interpreter_active", lambda: False)
    monkeypatch.setattr(pdl, "_triton_supports_pdl", lambda: True)
    monkeypatch.delenv("DOVETAIL_TRITON_PDL", raising=False)
    meta = torch.device("meta")
    splits = {}
    for multiprocessors, answer in ((4, True), (132, False)):
        fake = _FakeGpu(multiprocessors, answer)
        monkeypatch.setitem(selection._DEVICE_PLATFORMS, "meta", fake)
        monkeypatch.setattr(unit_counts, "_SM_COUNT", {})
        pdl._use_pdl_on.cache_clear()
        assert pdl.use_pdl(meta) is answer
        assert unit_counts.multiprocessor_count(meta) == multiprocessors
        splits[multiprocessors] = paged_attention.default_num_splits(1, 2, meta)
        assert ("supports_pdl", None) in fake.asked and ("multiprocessor_count", None) in fake.asked
    pdl._use_pdl_on.cache_clear()
    assert splits == {4: 8, 132: 16}


def test_without_a_platform_made_for_a_device_type_the_best_usable_one_answers(monkeypatch):
    from dovetail import selection

    monkeypatch.setattr(selection, "_DEVICE_PLATFORMS", {})
    assert selection.platform_for_device("cpu").name == "cpu"  # the CPU plugin outranks the toy accelerator
    toy = selection.create_platform("toy")
    assert selection.platform_for_device("cpu") is toy  # the platform created last for the device type
    assert selection.platform_for_device("no-such-device") is None
