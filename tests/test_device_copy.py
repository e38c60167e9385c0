"""Host-to-device copies go through pinned memory on an accelerator (a pageable source may stall the host until
the device's queued work is done) and stay as they are on the CPU."""

from __future__ import annotations

import torch

from dovetail.device_copy import copy_to_device, to_device, values_to_device


def _count_pinning(monkeypatch) -> list[torch.Tensor]:
    pinned = []

    def pin_memory(self, *args, **kwargs):
        pinned.append(self)
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a, **k: False)
    return pinned


def test_an_accelerator_copy_is_staged_in_pinned_memory(monkeypatch):
    pinned = _count_pinning(monkeypatch)
    host = torch.randint(0, 1000, (7,))
    moved = to_device(host, "meta")
    assert moved.device.type == "meta" and moved.shape == host.shape
    dst = torch.empty(7, dtype=host.dtype, device="meta")
    copy_to_device(dst, host)
    assert len(pinned) == 2 and all(p is host for p in pinned)
    listed = values_to_device([3, 1, 2], torch.int32, "meta")
    assert listed.device.type == "meta" and listed.dtype == torch.int32 and listed.shape == (3,) and len(pinned) == 3


def test_a_cpu_copy_needs_no_pinning(monkeypatch):
    pinned = _count_pinning(monkeypatch)
    host = torch.randn(5)
    assert torch.equal(to_device(host, torch.device("cpu")), host)
    dst = torch.zeros(5)
    copy_to_device(dst, host)
    assert torch.equal(dst, host) and not pinned
    assert torch.equal(values_to_device([3, 1, 2], torch.long, "cpu"), torch.tensor([3, 1, 2])) and not pinned
