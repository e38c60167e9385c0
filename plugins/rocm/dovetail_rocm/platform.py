"""The ``rocm`` platform: AMD GPUs through a ROCm (HIP) build of torch.

On ROCm, torch exposes HIP devices under the ``"cuda"`` device type and the
``torch.cuda`` API, and its ``"nccl"`` distributed backend is RCCL. Device
visibility and the device count come from the probe (KFD sysfs plus the
visibility variables), so constructing the platform does not start HIP; memory
queries call ``torch.cuda`` and do. Decode steps are captured as HIP graphs
through ``torch.cuda.CUDAGraph`` unless ``enforce_eager`` is set.
"""

from __future__ import annotations

import logging
import os

import torch

from dovetail.errors import ConfigError
from dovetail.platform import DeviceGraph, Platform, ProbeResult
from dovetail_rocm import probe as rocm_probe
from dovetail_rocm.aiter_support import aiter_unavailable_reason

logger = logging.getLogger("dovetail")

AITER_BACKEND = "ROCM_AITER"
#: Block sizes ROCM_AITER accepts; kept here so the platform need not import the backend.
AITER_BLOCK_SIZES = (16, 32)

VERIFICATION = (
    "NOT verified on hardware: no AMD GPU was available. Tested on CPU up to the probe boundary (a "
    "simulated KFD sysfs tree, visibility variables, torch.version.hip): probing, device counting, "
    "selection, config adjustments and the KV-cache budget arithmetic. Never executed: every torch.cuda "
    "call on a HIP device (memory queries, set_device, synchronize), HIP graph capture and replay, the "
    "core's Triton kernels on an AMD GPU, RCCL through torch.distributed. If graphs misbehave, "
    "run with enforce_eager."
)


#: Device memory kept outside the KV cache for the decode graphs when they are on.


class HipGraph(DeviceGraph):
    """A captured ``torch.cuda.CUDAGraph`` (a HIP graph on ROCm torch)."""

    def __init__(self, graph):
        self.graph = graph

    def replay(self) -> None:
        self.graph.replay()


class RocmPlatform(Platform):
    """AMD Instinct and Radeon GPUs under ROCm; the probe reads sysfs and never starts HIP."""

    name = "rocm"
    device_type = "cuda"
    verification = VERIFICATION
    dist_backend = "nccl"
    is_accelerator = True
    supports_graph_capture = True  # torch.cuda.CUDAGraph is a HIP graph on ROCm torch
    graph_memory_reserve = 1 << 30

    def __init__(self):
        self.devices = rocm_probe.find_devices()

    @classmethod
    def probe(cls) -> ProbeResult:
        return rocm_probe.probe()

    # -- devices and memory ------------------------------------------------------------

    def device_count(self) -> int:
        return len(self.devices.visible)

    def set_device(self, index: int = 0) -> None:
        torch.cuda.set_device(index)

    def memory_total(self, index: int = 0) -> int:
        return torch.cuda.mem_get_info(index)[1]

    def memory_free(self, index: int = 0) -> int:
        return torch.cuda.mem_get_info(index)[0]

    def memory_stats(self, index: int = 0) -> dict[str, int]:
        return {"allocated": torch.cuda.memory_allocated(index),
                "peak_allocated": torch.cuda.max_memory_allocated(index),
                "reserved": torch.cuda.memory_reserved(index)}

    def reset_peak_memory_stats(self, index: int = 0) -> None:
        torch.cuda.reset_peak_memory_stats(index)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    # -- numerics ------------------------------------------------------------------------

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    def resolve_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """Half-precision checkpoints keep their dtype; float32 (or unknown) ones run in bfloat16."""
        if checkpoint_dtype in (torch.float16, torch.bfloat16):
            return checkpoint_dtype
        logger.info("rocm: dtype 'auto' runs the %s checkpoint in bfloat16 (pass dtype='float32' to keep it)",
                    str(checkpoint_dtype).removeprefix("torch.") if checkpoint_dtype else "unknown-dtype")
        return torch.bfloat16

    def fused_ops(self):
        """The core's Triton fused ops when triton imports, else plain torch."""
        from dovetail.triton import triton_missing_reason

        if triton_missing_reason() is None:
            from dovetail.triton.fused_ops import TritonFusedOps

            return TritonFusedOps()
        return super().fused_ops()

    # -- engine integration ----------------------------------------------------------------

    def default_attention_backends(self) -> list[str]:
        if aiter_unavailable_reason() is None:
            return [AITER_BACKEND, "TRITON", "REFERENCE"]
        return ["TRITON", "REFERENCE"]

    def check_and_update_config(self, config) -> None:
        """Fit the KV block size to ROCM_AITER when AITER is asked for, or will be chosen automatically."""
        requested = config.device.attention_backend or os.environ.get("DOVETAIL_ATTENTION_BACKEND") or "auto"
        wants_aiter = requested == AITER_BACKEND or (requested.lower() == "auto" and aiter_unavailable_reason() is None)
        block_size = config.cache.block_size
        if not wants_aiter or block_size in AITER_BLOCK_SIZES:
            return
        user_set = "block_size" in config.cache.model_fields_set
        if requested == AITER_BACKEND and user_set:
            raise ConfigError(f"block_size: {block_size} is not supported by attention backend {AITER_BACKEND} "
                              f"(supported: {', '.join(map(str, AITER_BLOCK_SIZES))})")
        if not user_set:
            config.cache.block_size = AITER_BLOCK_SIZES[0]
            logger.info("rocm: block_size set to %d for attention backend %s", AITER_BLOCK_SIZES[0], AITER_BACKEND)

    # -- graphs --------------------------------------------------------------------------

    def graph_pool(self):
        return torch.cuda.graph_pool_handle()

    def capture_graph(self, fn, pool=None):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return HipGraph(graph), out

    def describe(self) -> str:
        if self.devices.problem:
            return f"rocm (not usable: {self.devices.problem})"
        return f"rocm ({self.devices.summary()})"
