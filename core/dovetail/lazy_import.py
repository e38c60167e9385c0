"""Resolve the lazy ``"module:attribute"`` paths that plugins register."""

import importlib


def resolve(path: str):
    """Import ``module`` and return ``attribute`` for a ``"module:attribute"`` path."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected 'module:attribute', got {path!r}")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
