"""Host-to-device copies that leave the host free to go on.

A copy from pageable host memory may wait for the work already queued on the device (the driver stages it
through pinned memory of its own), and the host, blocked in it, cannot prepare the next step while the device
runs this one. On an accelerator a host tensor is therefore moved to pinned memory first; torch's pinned-memory
allocator keeps that buffer until the copy has run before handing it out again.
"""

from __future__ import annotations

import torch


def _pinned(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu" or host.device.type != "cpu" or host.is_pinned():
        return host
    return host.pin_memory()


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` on ``device``, the copy queued without waiting (on the CPU, ``host`` itself)."""
    device = torch.device(device)
    return _pinned(host, device).to(device, non_blocking=True)


def copy_to_device(dst: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(host)``, the copy queued without waiting (see :func:`to_device`)."""
    return dst.copy_(_pinned(host, dst.device), non_blocking=True)


def values_to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, the copy queued without waiting (see :func:`to_device`)."""
    return to_device(torch.tensor(values, dtype=dtype), device)
