"""TorchDevicePlatform routes a GPU platform's runtime calls to ``torch.<device_type>``."""

from __future__ import annotations

import torch

from dovetail.platform import ProbeResult
from dovetail.torch_device_platform import TorchDevicePlatform


class FakeRuntime:
    """Stands in for ``torch.cuda``/``torch.xpu``: records calls, reports fixed numbers."""

    def __init__(self):
        self.calls = []

    def set_device(self, index):
        self.calls.append(("set_device", index))

    def mem_get_info(self, index):
        return (3 << 30, 8 << 30)

    def memory_allocated(self, index):
        return 11

    def max_memory_allocated(self, index):
        return 22

    def memory_reserved(self, index):
        return 33

    def reset_peak_memory_stats(self, index):
        self.calls.append(("reset", index))

    def synchronize(self):
        self.calls.append(("synchronize",))

    def empty_cache(self):
        self.calls.append(("empty_cache",))


class FakeGpu(TorchDevicePlatform):
    """A platform over the fake runtime."""

    name = "fakegpu"
    device_type = "fakegpu"

    @classmethod
    def probe(cls) -> ProbeResult:
        return ProbeResult.ok()

    def device_count(self) -> int:
        return 1

    def default_attention_backends(self) -> list[str]:
        return ["REFERENCE"]


def test_runtime_calls_go_to_the_device_module(monkeypatch):
    runtime = FakeRuntime()
    monkeypatch.setattr(torch, "fakegpu", runtime, raising=False)
    platform = FakeGpu()
    platform.set_device(1)
    platform.reset_peak_memory_stats(1)
    platform.synchronize()
    platform.empty_cache()
    assert runtime.calls == [("set_device", 1), ("reset", 1), ("synchronize",), ("empty_cache",)]
    assert (platform.memory_total(), platform.memory_free()) == (8 << 30, 3 << 30)
    assert platform.memory_stats() == {"allocated": 11, "peak_allocated": 22, "reserved": 33}


def test_allocator_counts_come_from_the_device_module_where_it_keeps_them(monkeypatch):
    runtime = FakeRuntime()
    runtime.memory_stats = lambda index: {"num_alloc_retries": 2, "num_device_alloc": 5, "num_device_free": 1,
                                          "active.all.current": 7}
    runtime.host_memory_stats = lambda: {"num_host_alloc": 4, "host_alloc_time.total": 120, "num_host_free": 0}
    monkeypatch.setattr(torch, "fakegpu", runtime, raising=False)
    assert FakeGpu().memory_stats(0) == {"allocated": 11, "peak_allocated": 22, "reserved": 33, "alloc_retries": 2,
                                         "device_allocs": 5, "device_frees": 1, "host_allocs": 4,
                                         "host_alloc_us": 120}


def test_half_checkpoints_keep_their_dtype_and_float32_runs_in_16_bits(monkeypatch):
    platform = FakeGpu()
    assert platform.resolve_dtype(torch.float16) == torch.float16
    assert platform.resolve_dtype(torch.bfloat16) == torch.bfloat16
    assert platform.resolve_dtype(torch.float32) == torch.bfloat16 and platform.resolve_dtype(None) == torch.bfloat16
    monkeypatch.setattr(FakeGpu, "supported_dtypes", lambda self: [torch.float16, torch.float32])
    assert platform.resolve_dtype(torch.bfloat16) == torch.float16


def test_fused_ops_fall_back_to_torch_without_triton(monkeypatch):
    from dovetail import triton as dovetail_triton
    from dovetail.ops import FusedOps

    monkeypatch.setattr(dovetail_triton, "triton_missing_reason", lambda: "triton is not installed")
    assert type(FakeGpu().fused_ops()) is FusedOps
