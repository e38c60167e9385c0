"""Install throwaway plugin distributions (a dist-info with an entry point) on sys.path for tests."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path


def install_fake_plugin(root: Path, monkeypatch, entry_name: str, module_name: str, source: str,
                        dist_name: str | None = None, version: str = "0.0.1") -> None:
    """Write ``module_name.py`` and a dist-info declaring ``entry_name = module_name`` in group ``dovetail``."""
    dist_name = dist_name or f"fake-{entry_name}"
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module_name}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist_name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[dovetail]\n{entry_name} = {module_name}\n")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, module_name, raising=False)
    importlib.invalidate_caches()
