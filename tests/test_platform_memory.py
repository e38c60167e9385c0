"""The core's KV-cache sizing for accelerators: total x utilization, less the profile, outside memory, reserve."""

from __future__ import annotations

import pytest

from dovetail.config import EngineArgs
from dovetail.errors import ConfigError
from dovetail.platform import Platform, ProbeResult

GIB = 2**30


class FakeAccelerator(Platform):
    """An accelerator with 80 GiB, of which 70 are free and 6 held by torch's allocator."""

    name, device_type = "fake", "cpu"
    graph_memory_reserve = GIB

    @classmethod
    def probe(cls):
        return ProbeResult.ok()

    def device_count(self):
        return 1

    def memory_total(self, index=0):
        return 80 * GIB

    def memory_free(self, index=0):
        return 70 * GIB

    def memory_stats(self, index=0):
        return {"reserved": 6 * GIB}

    def supported_dtypes(self):
        raise NotImplementedError

    def default_attention_backends(self):
        return []


def _config(**kwargs):
    return EngineArgs("/m", **kwargs).create_engine_config()


def test_budget_subtracts_profile_outside_memory_and_graph_reserve():
    budget = FakeAccelerator().kv_cache_bytes(_config(gpu_memory_utilization=0.5), lambda: 3 * GIB)
    # 40 GiB - 3 GiB profiled - (80 - 70 - 6) GiB outside torch - 1 GiB for graphs
    assert budget == 32 * GIB
    eager = FakeAccelerator().kv_cache_bytes(_config(gpu_memory_utilization=0.5, enforce_eager=True), lambda: 3 * GIB)
    assert eager == 33 * GIB


def test_no_room_names_gpu_memory_utilization():
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization: 0.05 leaves no memory for the KV cache"):
        FakeAccelerator().kv_cache_bytes(_config(gpu_memory_utilization=0.05), lambda: 3 * GIB)
