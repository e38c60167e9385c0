"""The ``cpu`` platform: threads, a KV-cache byte budget, bf16 when the CPU has it, the C++ kernels."""

from __future__ import annotations

import logging
import os

import torch

from dovetail.config import DEFAULT_KV_CACHE_BYTES
from dovetail.errors import ConfigError
from dovetail.platform import Platform, ProbeResult
from dovetail_cpu import cpu_info
from dovetail_cpu.allocator import keep_large_allocations_in_heap

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


def _omp_num_threads() -> int | None:
    """The first level of ``OMP_NUM_THREADS``, or None when it is unset."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return None
    first = value.split(",")[0].strip()
    if not first.isdigit() or int(first) < 1:
        raise ConfigError(f"OMP_NUM_THREADS: expected a positive integer, got {value!r}")
    return int(first)


class CpuPlatform(Platform):
    """Runs on the host CPU; the KV cache is a byte budget (``kv_cache_memory_bytes``).

    Threads: ``--cpu-threads``, else ``OMP_NUM_THREADS``, else every core this process may use, divided
    among the tensor-parallel ranks; torch and the C++ kernels share that one OpenMP pool.

    Under tensor parallelism a rank is a process and the device is the host: the ranks share its cores
    and memory (``kv_cache_memory_bytes`` is each rank's; the default budget is split among them), talk
    over gloo, and any number of them is accepted.
    """

    name = "cpu"
    device_type = "cpu"
    verification = ("verified on x86-64 (AMD EPYC Zen 4, 2 cores, AVX-512 with BF16) in CI: conformance kit, "
                    "kernels against REFERENCE on every ISA path, greedy equality with HF")
    dist_backend = "gloo"
    is_accelerator = False
    supports_graph_capture = False
    ray_device_key = "CPU"

    @classmethod
    def probe(cls) -> ProbeResult:
        return cpu_info.probe()

    def device_count(self) -> int:
        return 1

    def check_world_size(self, world_size: int) -> None:
        cores = cpu_info.usable_cores()
        if world_size > cores:
            logger.warning("cpu: %d ranks share %d usable cores; they will wait on each other", world_size, cores)

    def memory_total(self, index: int | None = None) -> int:
        return _total_memory()

    def memory_free(self, index: int | None = None) -> int:
        return _available_memory()

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16] if cpu_info.has_bf16() else [torch.float32]

    def default_attention_backends(self) -> list[str]:
        return ["CPU_SIMD", "REFERENCE"]

    def attention_backend_order_reason(self) -> str:
        return ("CPU_SIMD comes first, the faster measured: C1 711 output tok/s against REFERENCE's 497 (2-core Zen 4, "
                "float32); benchmarks/RESULTS.md, CPU")

    def quant_kernels(self):
        from dovetail_cpu.quant_kernels import CpuQuantKernels

        return CpuQuantKernels()

    def fused_ops(self):
        from dovetail_cpu import _native

        missing = _native.missing_reason()
        if missing:
            logger.warning("cpu: %s; using the plain torch fused ops", missing)
            return super().fused_ops()
        from dovetail_cpu.ops import CpuFusedOps

        return CpuFusedOps()

    def check_and_update_config(self, config) -> None:
        if not config.device.enforce_eager:
            config.device.enforce_eager = True
        threads, source = config.device.cpu_threads, "--cpu-threads"
        if threads is None:
            threads, source = _omp_num_threads(), "OMP_NUM_THREADS"
        cores = cpu_info.usable_cores()
        ranks = config.parallel.tensor_parallel_size
        if threads is None and ranks > 1:
            threads, source = max(1, cores // ranks), f"the cores this process may use, shared by {ranks} ranks"
        elif threads is None:
            threads, source = cores, "the cores this process may use"
        if threads > cores:
            logger.warning("cpu: %d threads (%s) for %d usable cores; threads will wait on each other",
                           threads, source, cores)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        logger.info("cpu: %d threads (from %s)", threads, source)
        keep_large_allocations_in_heap()

    def kv_cache_bytes(self, config, profile) -> int:
        requested = config.cache.kv_cache_memory_bytes
        if requested is not None:
            if requested > _available_memory():
                logger.warning("cpu: kv_cache_memory_bytes=%d exceeds the %d bytes of memory available now",
                               requested, _available_memory())
            return requested
        # The ranks of tensor parallelism share the host's memory: the default budget is split among them.
        return min(DEFAULT_KV_CACHE_BYTES, _available_memory() // 2) // config.parallel.tensor_parallel_size

    def describe(self) -> str:
        from dovetail_cpu import _native

        kernels = "kernels not built" if _native.missing_reason() else f"kernels: {_native.current_isa()}"
        return f"cpu ({cpu_info.probe().reason}; {kernels}; {torch.get_num_threads()} threads)"
