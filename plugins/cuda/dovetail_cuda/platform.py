"""The ``cuda`` platform: NVIDIA GPUs through a CUDA build of torch.

The probe (:mod:`dovetail_cuda.probe`) uses NVML and never initialises CUDA;
constructing the platform does. Memory is ``torch.cuda``'s, the distributed
backend is NCCL, decode steps are captured as CUDA graphs, the fused ops are the
core's Triton kernels, and FP8 linears on sm89+ use a Triton weight-only GEMV up to 16
tokens and ``torch._scaled_mm`` above. Selecting the device makes torch's matrix products go through
cuBLASLt (``DOVETAIL_CUDA_BLAS``: :func:`blas_library`).
"""

from __future__ import annotations

import logging
import os

import torch

from dovetail.errors import ConfigError
from dovetail.platform import HostCopy, ProbeResult
from dovetail.torch_device_platform import TorchDevicePlatform
from dovetail_cuda import probe as cuda_probe

logger = logging.getLogger("dovetail")

VERIFICATION = (
    "verified on NVIDIA H200 and H100 GPUs (sm_90, driver 580.159, torch 2.11.0+cu130): the NVML probe, "
    "KV-cache sizing from gpu_memory_utilization, CUDA graphs (greedy tokens identical on and off), one host "
    "synchronisation per step, greedy output against HF with FLASHINFER, TRITON and REFERENCE, and the "
    "CUDA C++ FP8 GEMV (nvcc 13.0, sm_90a). Never exercised: NCCL through torch.distributed (the engine runs one "
    "device), GPUs other than Hopper (the FP8 GEMV's sm_89 build included)"
)


def blas_library() -> str:
    """The library torch's matrix products use once the engine selects its device: ``DOVETAIL_CUDA_BLAS``,
    ``cublaslt`` (the default) or ``cublas``. It is a process-wide torch setting.

    cuBLASLt ran llama-3.1-8b's B1 faster than cuBLAS on Hopper (benchmarks/RESULTS.md, H200).
    """
    choice = os.environ.get("DOVETAIL_CUDA_BLAS", "cublaslt").strip().lower()
    if choice not in ("cublaslt", "cublas"):
        raise ConfigError(f"DOVETAIL_CUDA_BLAS={choice!r}: expected 'cublaslt' or 'cublas'")
    return choice


class _CudaHostCopy(HostCopy):
    """A copy into pinned host memory, ordered on the current stream, with an event to wait on."""

    def __init__(self, tensor: torch.Tensor):
        self._host = tensor.to("cpu", non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def wait(self) -> torch.Tensor:
        self._event.synchronize()
        return self._host


class CudaPlatform(TorchDevicePlatform):
    """NVIDIA GPUs; the probe reads NVML and honours ``CUDA_VISIBLE_DEVICES`` without starting CUDA."""

    name = "cuda"
    device_type = "cuda"
    verification = VERIFICATION
    dist_backend = "nccl"
    supports_graph_capture = True
    graph_memory_reserve = 1 << 30

    @classmethod
    def probe(cls) -> ProbeResult:
        return cuda_probe.probe()

    # -- devices and memory ------------------------------------------------------------

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def set_device(self, index: int = 0) -> None:
        """Select device ``index`` and the BLAS library of :func:`blas_library`."""
        library = blas_library()
        super().set_device(index)
        torch.backends.cuda.preferred_blas_library(library)

    def capability(self, index: int = 0) -> tuple[int, int]:
        """The compute capability of device ``index``, e.g. ``(9, 0)`` on Hopper."""
        return torch.cuda.get_device_capability(index)

    def default_batch_limits(self, usage: str) -> tuple[int, int]:
        """vLLM's rule: on devices of 70 GiB or more (not the A100, whose throughput drops with larger
        budgets) 16384 batched tokens offline and 8192 when serving, with up to 1024 sequences."""
        if self.memory_total(0) >= 70 * 2**30 and "a100" not in torch.cuda.get_device_name(0).lower():
            return (16384 if usage == "llm" else 8192), 1024
        return super().default_batch_limits(usage)

    def copy_to_host_async(self, tensor: torch.Tensor) -> HostCopy:
        return _CudaHostCopy(tensor)

    # -- numerics ------------------------------------------------------------------------

    def supported_dtypes(self) -> list[torch.dtype]:
        if self.capability() >= (8, 0):
            return [torch.bfloat16, torch.float16, torch.float32]
        return [torch.float16, torch.float32]

    def quant_kernels(self):
        """On sm89+ (Ada, Hopper): FP8 on a CUDA C++ GEMV (one token), a Triton GEMV (up to 16) or
        ``_scaled_mm``, INT8 ``_int_mm``, Triton for 4/8-bit."""
        if self.capability() >= (8, 9):
            from dovetail_cuda.quant_kernels import CudaQuantKernels

            return CudaQuantKernels()
        return super().quant_kernels()

    # -- engine integration ----------------------------------------------------------------

    def default_attention_backends(self) -> list[str]:
        return ["FLASH_ATTN", "FLASHINFER", "TRITON", "REFERENCE"]

    def check_and_update_config(self, config) -> None:
        """FlashAttention-2's paged cache needs blocks of 256 tokens: set it when FLASH_ATTN is asked for and
        neither FlashAttention-3 nor 4 runs on this GPU."""
        requested = config.device.attention_backend or os.environ.get("DOVETAIL_ATTENTION_BACKEND")
        if requested != "FLASH_ATTN" or "block_size" in config.cache.model_fields_set:
            return
        from dovetail_cuda.flash_attn_backend import FA2_BLOCK_MULTIPLE, fa3_installed, fa4_installed, variant

        major = self.capability()[0] if fa3_installed() or fa4_installed() else 0
        if variant(major) == "fa2" and config.cache.block_size % FA2_BLOCK_MULTIPLE:
            config.cache.block_size = FA2_BLOCK_MULTIPLE
            logger.info("cuda: block_size set to %d for FLASH_ATTN (FlashAttention-2)", FA2_BLOCK_MULTIPLE)

    def describe(self) -> str:
        devices = cuda_probe.find_devices()
        return f"cuda ({devices.problem or devices.summary()})"
