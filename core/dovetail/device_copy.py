"""Host-to-device copies that leave the host free to go on.

A copy from pageable host memory may wait for the work already queued on the device (the driver stages it
through pinned memory of its own), and the host, blocked in it, cannot prepare the next step while the device
runs this one. On an accelerator a host tensor is therefore moved to pinned memory first; torch's pinned-memory
allocator keeps that buffer until the copy has run before handing it out again.

That allocator rounds each request up to a power of two and reuses only a free block of that size; when it has
none, it makes one, and making pinned memory can hold the host for milliseconds while the device runs dry.
A step's inputs change size as its batch shrinks and its sequences grow, so a long run keeps meeting sizes whose
blocks are all in flight. :func:`reserve_pinned_blocks` has the allocator make them all before the first step.
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


#: The smallest pinned block :func:`reserve_pinned_blocks` reserves, in bytes.
SMALLEST_PINNED_BLOCK = 512


def reserve_pinned_blocks(largest_bytes: int, device: torch.device | str, per_size: int = 8) -> int:
    """Leave ``per_size`` free pinned blocks of every power-of-two size up to ``largest_bytes`` in torch's
    pinned-memory allocator, so that a step's host copies find a block ready (none on the CPU). Returns the bytes
    reserved."""
    if torch.device(device).type == "cpu" or largest_bytes <= 0:
        return 0
    held, size = [], SMALLEST_PINNED_BLOCK
    while True:
        held.extend(torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(per_size))
        if size >= largest_bytes:
            break
        size *= 2
    reserved = sum(block.numel() for block in held)
    del held  # back to the allocator's free lists, each at its size
    return reserved

