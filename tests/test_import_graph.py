"""The core's modules import one another without a cycle: every import counts, at module level, inside functions
and under ``TYPE_CHECKING`` alike (a cycle hidden by a deferred import still ties the modules' concepts together)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "core"


def core_modules() -> dict[str, Path]:
    modules = {}
    for path in (CORE / "dovetail").rglob("*.py"):
        parts = list(path.relative_to(CORE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The core modules ``module`` imports anywhere in its source (``from package import name`` counts the
    submodule ``package.name`` when there is one, else the package)."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        found.update(r for r in map(resolve, names) if r and r != module)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_reader_sees_deferred_and_type_checking_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dovetail.ops import FusedOps\n"
                      "def f():\n    from dovetail.layers import moe\n    import dovetail.platform\n")
    modules = core_modules()
    assert imports_of("dovetail.x", source, modules) == {"dovetail.ops", "dovetail.layers", "dovetail.layers.moe",
                                                         "dovetail.platform"}


def test_core_modules_import_without_a_cycle():
    modules = core_modules()
    assert "dovetail.ops" in modules and "dovetail.layers.moe" in modules
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    found = cycles(graph)
    if found:
        pytest.fail("import cycles among core modules (each line one cycle's modules):\n"
                    + "\n".join(" <-> ".join(c) for c in found))
