"""Host-to-device copies go through pinned memory on an accelerator (a pageable source may stall the host until
the device's queued work is done) and stay as they are on the CPU."""

from __future__ import annotations

import pytest
import torch

from dovetail import device_copy
from dovetail.device_copy import copy_to_device, reserve_pinned_blocks, to_device, values_to_device


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


def test_pinned_blocks_are_reserved_at_every_power_of_two_up_to_the_largest(monkeypatch):
    made = []
    real_empty = torch.empty

    def empty(size, dtype=None, pin_memory=False):
        assert pin_memory and dtype == torch.uint8
        made.append(size)
        return real_empty(size, dtype=dtype)

    monkeypatch.setattr(device_copy.torch, "empty", empty)
    reserved = reserve_pinned_blocks(3000, "meta", per_size=3)
    assert made == [512] * 3 + [1024] * 3 + [2048] * 3 + [4096] * 3 and reserved == 3 * (512 + 1024 + 2048 + 4096)
    made.clear()
    assert reserve_pinned_blocks(3000, "cpu") == 0 and not made  # nothing to pin for the CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_copy_of_a_reserved_size_makes_no_new_pinned_block():
    reserve_pinned_blocks(300_000, "cuda")
    before = torch.cuda.host_memory_stats()["num_host_alloc"]
    dst = torch.empty(300_000 // 8, dtype=torch.long, device="cuda")
    for n in (100, 5_000, 37_000):  # 800 B, 40 kB, 296 kB: three of the reserved sizes, twice each
        for _ in range(2):
            source = torch.randint(0, 1 << 40, (n,))
            copy_to_device(dst[:n], source)
            torch.cuda.synchronize()
            assert torch.equal(dst[:n].cpu(), source)
    assert torch.cuda.host_memory_stats()["num_host_alloc"] == before

