"""TorchDevicePlatform: what a GPU platform gets from its torch device module.

CUDA and ROCm builds of torch expose their devices as ``torch.cuda``, Intel GPUs as
``torch.xpu``; the module (``torch.<device_type>``) answers device selection, memory,
allocator statistics, synchronisation and, on ``torch.cuda``, graph capture. A plugin
for such a GPU subclasses this and adds its probe, backends and configuration rules.
"""

from __future__ import annotations

import logging

import torch

from dovetail.platform import DeviceGraph, Platform

#: The caching allocator's counts :meth:`TorchDevicePlatform.memory_stats` reports, by torch's names.
_ALLOCATOR_COUNTS = {"alloc_retries": "num_alloc_retries", "device_allocs": "num_device_alloc",
                     "device_frees": "num_device_free"}
#: The pinned host allocator's, where the device module has one.
_HOST_ALLOCATOR_COUNTS = {"host_allocs": "num_host_alloc", "host_alloc_us": "host_alloc_time.total"}

logger = logging.getLogger("dovetail")


class TorchDeviceGraph(DeviceGraph):
    """A graph captured with ``torch.cuda.CUDAGraph`` (a HIP graph on ROCm builds of torch)."""

    def __init__(self, graph):
        self.graph = graph

    def replay(self) -> None:
        self.graph.replay()


class TorchDevicePlatform(Platform):
    """A GPU whose runtime is ``torch.<device_type>``: memory, synchronisation and graphs from that module.

    Memory queries without an index are about the current device (the one :meth:`set_device` chose for
    this rank).

    Half-precision checkpoints keep their dtype and the others run in the first 16-bit dtype of
    :meth:`supported_dtypes`; the fused ops are the core's Triton kernels when triton imports.
    """

    is_accelerator = True

    @property
    def runtime(self):
        """``torch.cuda``, ``torch.xpu``, ...: the torch module of this platform's device type."""
        return getattr(torch, self.device_type)

    # -- devices and memory ------------------------------------------------------------

    def set_device(self, index: int = 0) -> None:
        self.runtime.set_device(index)

    def memory_total(self, index: int | None = None) -> int:
        return self.runtime.mem_get_info(index)[1]

    def memory_free(self, index: int | None = None) -> int:
        return self.runtime.mem_get_info(index)[0]

    def memory_stats(self, index: int | None = None) -> dict[str, int]:
        runtime = self.runtime
        counts = runtime.memory_stats(index) if hasattr(runtime, "memory_stats") else {}
        host = runtime.host_memory_stats() if hasattr(runtime, "host_memory_stats") else {}
        return {"allocated": runtime.memory_allocated(index), "peak_allocated": runtime.max_memory_allocated(index),
                "reserved": runtime.memory_reserved(index),
                **{name: counts[key] for name, key in _ALLOCATOR_COUNTS.items() if key in counts},
                **{name: host[key] for name, key in _HOST_ALLOCATOR_COUNTS.items() if key in host}}

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        self.runtime.reset_peak_memory_stats(index)

    def multiprocessor_count(self, index: int | None = None) -> int:
        """The ``multi_processor_count`` of the device's properties (multiprocessors on NVIDIA GPUs, compute
        units on AMD ones)."""
        runtime = self.runtime
        props = runtime.get_device_properties(runtime.current_device() if index is None else index)
        return int(getattr(props, "multi_processor_count", 0))

    def synchronize(self) -> None:
        self.runtime.synchronize()

    def empty_cache(self) -> None:
        self.runtime.empty_cache()

    # -- numerics ------------------------------------------------------------------------

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    def resolve_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """Half-precision checkpoints keep their dtype; float32 (or unknown) ones run in 16 bits."""
        supported = self.supported_dtypes()
        if checkpoint_dtype in (torch.float16, torch.bfloat16) and checkpoint_dtype in supported:
            return checkpoint_dtype
        chosen = supported[0]
        logger.info("%s: dtype 'auto' runs the %s checkpoint in %s (pass dtype='float32' to keep it)", self.name,
                    str(checkpoint_dtype).removeprefix("torch.") if checkpoint_dtype else "unknown-dtype",
                    str(chosen).removeprefix("torch."))
        return chosen

    def fused_ops(self):
        """The core's Triton fused ops (RMSNorm with residual, rotary, SiLU-and-mul), else plain torch."""
        from dovetail.triton import triton_missing_reason

        missing = triton_missing_reason()
        if missing:
            logger.warning("%s: fused ops run in plain torch: %s", self.name, missing)
            return super().fused_ops()
        from dovetail.triton.fused_ops import TritonFusedOps

        return TritonFusedOps()

    # -- graphs (torch.cuda) ---------------------------------------------------------------

    def graph_pool(self):
        return self.runtime.graph_pool_handle()

    def capture_graph(self, fn, pool=None):
        graph = self.runtime.CUDAGraph()
        with self.runtime.graph(graph, pool=pool):
            out = fn()
        return TorchDeviceGraph(graph), out
