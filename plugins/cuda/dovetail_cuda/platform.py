"""The ``cuda`` platform: NVIDIA GPUs through a CUDA build of torch.

The probe (:mod:`dovetail_cuda.probe`) uses NVML and never initialises CUDA;
constructing the platform does. Memory is ``torch.cuda``'s, the distributed
backend is NCCL, decode steps are captured as CUDA graphs, the fused ops are the
core's Triton kernels, and FP8 linears on sm89+ use a Triton weight-only GEMV up to 16
tokens and ``torch._scaled_mm`` above.
"""

from __future__ import annotations

import logging
import os

import torch

from dovetail.platform import DeviceGraph, HostCopy, Platform, ProbeResult
from dovetail_cuda import probe as cuda_probe

logger = logging.getLogger("dovetail")

#: Device memory kept outside the KV cache for the CUDA graphs and the attention workspaces.

VERIFICATION = (
    "verified on one NVIDIA H200 (sm_90, driver 580.159, torch 2.11.0+cu130) on 2026-11-20: the NVML probe, "
    "KV-cache sizing from gpu_memory_utilization, CUDA graphs (greedy tokens identical on and off), one host "
    "synchronisation per step, greedy output against HF with FLASHINFER, TRITON and REFERENCE. Never exercised: "
    "NCCL through torch.distributed (the engine runs one device), GPUs other than Hopper"
)


class CudaGraph(DeviceGraph):
    """A captured ``torch.cuda.CUDAGraph``."""

    def __init__(self, graph: "torch.cuda.CUDAGraph"):
        self.graph = graph

    def replay(self) -> None:
        self.graph.replay()


class _CudaHostCopy(HostCopy):
    """A copy into pinned host memory, ordered on the current stream, with an event to wait on."""

    def __init__(self, tensor: torch.Tensor):
        self._host = tensor.to("cpu", non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def wait(self) -> torch.Tensor:
        self._event.synchronize()
        return self._host


class CudaPlatform(Platform):
    """NVIDIA GPUs; the probe reads NVML and honours ``CUDA_VISIBLE_DEVICES`` without starting CUDA."""

    name = "cuda"
    device_type = "cuda"
    verification = VERIFICATION
    dist_backend = "nccl"
    is_accelerator = True
    supports_graph_capture = True
    graph_memory_reserve = 1 << 30

    @classmethod
    def probe(cls) -> ProbeResult:
        return cuda_probe.probe()

    # -- devices and memory ------------------------------------------------------------

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def set_device(self, index: int = 0) -> None:
        torch.cuda.set_device(index)

    def capability(self, index: int = 0) -> tuple[int, int]:
        """The compute capability of device ``index``, e.g. ``(9, 0)`` on Hopper."""
        return torch.cuda.get_device_capability(index)

    def memory_total(self, index: int = 0) -> int:
        return torch.cuda.mem_get_info(index)[1]

    def memory_free(self, index: int = 0) -> int:
        return torch.cuda.mem_get_info(index)[0]

    def memory_stats(self, index: int = 0) -> dict[str, int]:
        return {"allocated": torch.cuda.memory_allocated(index),
                "peak_allocated": torch.cuda.max_memory_allocated(index),
                "reserved": torch.cuda.memory_reserved(index)}

    def default_batch_limits(self, usage: str) -> tuple[int, int]:
        """vLLM's rule: on devices of 70 GiB or more (not the A100, whose throughput drops with larger
        budgets) 16384 batched tokens offline and 8192 when serving, with up to 1024 sequences."""
        if self.memory_total(0) >= 70 * 2**30 and "a100" not in torch.cuda.get_device_name(0).lower():
            return (16384 if usage == "llm" else 8192), 1024
        return super().default_batch_limits(usage)

    def reset_peak_memory_stats(self, index: int = 0) -> None:
        torch.cuda.reset_peak_memory_stats(index)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def copy_to_host_async(self, tensor: torch.Tensor) -> HostCopy:
        return _CudaHostCopy(tensor)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    # -- numerics ------------------------------------------------------------------------

    def supported_dtypes(self) -> list[torch.dtype]:
        if self.capability() >= (8, 0):
            return [torch.bfloat16, torch.float16, torch.float32]
        return [torch.float16, torch.float32]

    def resolve_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """Half-precision checkpoints keep their dtype; float32 (or unknown) ones run in 16 bits."""
        supported = self.supported_dtypes()
        if checkpoint_dtype in (torch.float16, torch.bfloat16) and checkpoint_dtype in supported:
            return checkpoint_dtype
        chosen = supported[0]
        logger.info("cuda: dtype 'auto' runs the %s checkpoint in %s (pass dtype='float32' to keep it)",
                    str(checkpoint_dtype).removeprefix("torch.") if checkpoint_dtype else "unknown-dtype",
                    str(chosen).removeprefix("torch."))
        return chosen

    def fused_ops(self):
        """The core's Triton fused ops (RMSNorm with residual, rotary, SiLU-and-mul), else plain torch."""
        from dovetail.triton import triton_missing_reason

        missing = triton_missing_reason()
        if missing:
            logger.warning("cuda: fused ops run in plain torch: %s", missing)
            return super().fused_ops()
        from dovetail.triton.fused_ops import TritonFusedOps

        return TritonFusedOps()

    def quant_kernels(self):
        """On sm89+ (Ada, Hopper): FP8 on a Triton GEMV or ``_scaled_mm``, INT8 ``_int_mm``, Triton for 4/8-bit."""
        if self.capability() >= (8, 9):
            from dovetail.quantization.gpu_kernels import GpuQuantKernels

            return GpuQuantKernels()
        return super().quant_kernels()

    # -- engine integration ----------------------------------------------------------------

    def default_attention_backends(self) -> list[str]:
        return ["FLASH_ATTN", "FLASHINFER", "TRITON", "REFERENCE"]

    def check_and_update_config(self, config) -> None:
        """FlashAttention-2's paged cache needs blocks of 256 tokens: set it when FLASH_ATTN is asked for."""
        requested = config.device.attention_backend or os.environ.get("DOVETAIL_ATTENTION_BACKEND")
        if requested != "FLASH_ATTN" or "block_size" in config.cache.model_fields_set:
            return
        from dovetail_cuda.flash_attn_backend import FA2_BLOCK_MULTIPLE, fa3_installed

        if not fa3_installed() and config.cache.block_size % FA2_BLOCK_MULTIPLE:
            config.cache.block_size = FA2_BLOCK_MULTIPLE
            logger.info("cuda: block_size set to %d for FLASH_ATTN (FlashAttention-2)", FA2_BLOCK_MULTIPLE)

    # -- graphs --------------------------------------------------------------------------

    def graph_pool(self):
        return torch.cuda.graph_pool_handle()

    def capture_graph(self, fn, pool=None):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return CudaGraph(graph), out

    def describe(self) -> str:
        devices = cuda_probe.find_devices()
        return f"cuda ({devices.problem or devices.summary()})"
