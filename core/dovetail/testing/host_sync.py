"""A guard that fails when Dovetail's code reads a tensor's value on the host, for testing graph-safe paths anywhere.

A device graph (a CUDA graph) records kernels, not Python: code that reads a
device value on the host (``.item()``, ``.tolist()``, ``int(t)``, ``if t:``, a
copy to the CPU, or an op whose output size depends on values, such as
``nonzero``, ``bincount`` or a boolean mask) cannot be captured, and outside a
capture it stalls the step until the device catches up. ``torch.cuda`` has a
sync debug mode for that; this guard does the same on any device, the CPU
included, so CI checks the GPU paths' Python (their kernels running in triton's
interpreter).

Only calls made directly by modules of the ``dovetail`` package raise (triton's
interpreter and torch itself read tensors on the host legitimately).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch

#: Tensor methods that return or branch on a value on the host.
_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
            "unique", "bincount", "masked_select")
#: torch functions whose output size depends on the values.
_FUNCTIONS = ("nonzero", "unique", "bincount", "masked_select", "argwhere")


class HostSyncError(AssertionError):
    """A device value was read on the host inside :func:`forbid_host_sync`."""


def _called_from_dovetail() -> bool:
    frame = sys._getframe(2)
    module = frame.f_globals.get("__name__", "")
    return module.startswith("dovetail") and not module.startswith("dovetail.testing")


def _guard(name: str, original):
    def guarded(*args, **kwargs):
        if _called_from_dovetail():
            raise HostSyncError(f"{name} reads a tensor's value on the host (a host synchronisation that a device "
                                "graph cannot capture)")
        return original(*args, **kwargs)

    return guarded


def _guard_to(original):
    def to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu" and _called_from_dovetail():
            raise HostSyncError("Tensor.to('cpu') copies a tensor to the host (a host synchronisation)")
        return original(self, *args, **kwargs)

    return to


def _guard_getitem(original):
    def getitem(self, index):
        items = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items) and _called_from_dovetail():
            raise HostSyncError("indexing with a boolean mask sizes its result from the mask's values on the host")
        return original(self, index)

    return getitem


@contextlib.contextmanager
def forbid_host_sync() -> Iterator[None]:
    """Within the block, Dovetail code that reads a tensor's value on the host raises :class:`HostSyncError`."""
    saved = []

    def patch(owner, name: str, replacement) -> None:
        saved.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, replacement)

    try:
        for name in _METHODS:
            if hasattr(torch.Tensor, name):
                patch(torch.Tensor, name, _guard(f"Tensor.{name}", getattr(torch.Tensor, name)))
        for name in _FUNCTIONS:
            patch(torch, name, _guard(f"torch.{name}", getattr(torch, name)))
        patch(torch.Tensor, "to", _guard_to(torch.Tensor.to))
        patch(torch.Tensor, "__getitem__", _guard_getitem(torch.Tensor.__getitem__))
        yield
    finally:
        for owner, name, original in reversed(saved):
            if original is None:
                delattr(owner, name)  # it was inherited: uncover the base class's again
            else:
                setattr(owner, name, original)
