"""The ``cpu`` platform: threads, a KV-cache byte budget, bf16 when the CPU has it."""

from __future__ import annotations

import logging
import os

import torch

from dovetail.config import DEFAULT_KV_CACHE_BYTES
from dovetail.platform import Platform, ProbeResult
from dovetail_cpu import cpu_info

logger = logging.getLogger("dovetail")


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 1024**3


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return _available_memory()


class CpuPlatform(Platform):
    """Runs on the host CPU; the KV cache is a byte budget (``kv_cache_memory_bytes``)."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    is_accelerator = False
    supports_graph_capture = False

    @classmethod
    def probe(cls) -> ProbeResult:
        return cpu_info.probe()

    def device_count(self) -> int:
        return 1

    def memory_total(self, index: int = 0) -> int:
        return _total_memory()

    def memory_free(self, index: int = 0) -> int:
        return _available_memory()

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16] if cpu_info.has_bf16() else [torch.float32]

    def default_attention_backends(self) -> list[str]:
        return ["CPU_SIMD", "REFERENCE"]

    def check_and_update_config(self, config) -> None:
        if not config.device.enforce_eager:
            config.device.enforce_eager = True
        threads = config.device.cpu_threads
        if threads is None and os.environ.get("OMP_NUM_THREADS"):
            threads = int(os.environ["OMP_NUM_THREADS"])
        if threads is None:
            threads = cpu_info.usable_cores()
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
            logger.info("cpu: using %d threads", threads)

    def kv_cache_bytes(self, config, profile) -> int:
        requested = config.cache.kv_cache_memory_bytes
        if requested is not None:
            return requested
        return min(DEFAULT_KV_CACHE_BYTES, _available_memory() // 2)

    def describe(self) -> str:
        return f"cpu ({cpu_info.probe().reason})"
