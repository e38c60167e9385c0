"""The ``cuda`` platform: NVIDIA GPUs through a CUDA build of torch.

The probe (:mod:`dovetail_cuda.probe`) uses NVML and never initialises CUDA;
constructing the platform does. Memory is ``torch.cuda``'s, the distributed
backend is NCCL, decode steps are captured as CUDA graphs, the fused ops are the
core's Triton kernels, and FP8 linears on sm89+ use a Triton weight-only GEMV up to 16
tokens and ``torch._scaled_mm`` above. Selecting the device makes torch's matrix products go through
cuBLASLt (``DOVETAIL_CUDA_BLAS``: :func:`blas_library`).
"""

from __future__ import annotations

import contextlib
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


#: Auto-selection's order of attention backends on Hopper (sm_90), fastest first: TRITON ran llama-3.1-8b's B1
#: 3% ahead of FLASHINFER and level with FLASH_ATTN through FlashAttention-4 (which decodes with TRITON's kernel
#: there); FlashAttention-3 and FlashInfer's other kernels were not measured against it.
HOPPER_ATTENTION_ORDER = ("TRITON", "FLASH_ATTN", "FLASHINFER", "REFERENCE")
HOPPER_ORDER_REASON = (
    "on Hopper TRITON comes first, the fastest measured: llama-3.1-8b B1 10,762-10,794 output tok/s against "
    "FLASHINFER's 10,445-10,448 (H200), and level with FLASH_ATTN through FlashAttention-4 (9,115 against 9,110, "
    "H100); benchmarks/RESULTS.md, GPU")
#: On other NVIDIA GPUs nothing was measured: vLLM's preference, FlashAttention first.
UNMEASURED_ATTENTION_ORDER = ("FLASH_ATTN", "FLASHINFER", "TRITON", "REFERENCE")


def visible_capability_major() -> int | None:
    """The compute capability major of the visible GPUs, from NVML (CUDA stays uninitialised); None when they
    differ or NVML cannot tell."""
    majors = {gpu.capability[0] for gpu in cuda_probe.find_devices().visible}
    return majors.pop() if len(majors) == 1 else None


def blas_library() -> str:
    """The library torch's matrix products use once the engine selects its device: ``DOVETAIL_CUDA_BLAS``,
    ``cublaslt`` (the default) or ``cublas``. It is a process-wide torch setting.

    cuBLASLt ran llama-3.1-8b's B1 faster than cuBLAS on Hopper (benchmarks/RESULTS.md, H200).
    """
    choice = os.environ.get("DOVETAIL_CUDA_BLAS", "cublaslt").strip().lower()
    if choice not in ("cublaslt", "cublas"):
        raise ConfigError(f"DOVETAIL_CUDA_BLAS={choice!r}: expected 'cublaslt' or 'cublas'")
    return choice


def gemv_max_rows() -> int:
    """``DOVETAIL_GEMV_MAX_ROWS``: the most tokens whose 16-bit linears run the core's Triton GEMV on Hopper
    instead of cuBLAS (default :data:`dovetail.triton.fused_ops.GEMV_MAX_ROWS`; 0 keeps every linear on cuBLAS)."""
    from dovetail.triton.fused_ops import GEMV_MAX_ROWS

    return _rows_setting("DOVETAIL_GEMV_MAX_ROWS", GEMV_MAX_ROWS)


def gated_gemv_max_rows() -> int:
    """``DOVETAIL_GATED_GEMV_MAX_ROWS``: the most tokens whose 16-bit gate/up projections run the core's gated
    Triton GEMV on Hopper (the product and the activation in one launch) instead of cuBLAS and the activation's
    kernel (default :data:`dovetail.triton.fused_ops.GATED_GEMV_MAX_ROWS`; 0 turns it off)."""
    from dovetail.triton.fused_ops import GATED_GEMV_MAX_ROWS

    return _rows_setting("DOVETAIL_GATED_GEMV_MAX_ROWS", GATED_GEMV_MAX_ROWS)


def _rows_setting(variable: str, default: int) -> int:
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    if not text.isdigit():
        raise ConfigError(f"{variable}={text!r}: expected a whole number of tokens (0 turns the GEMV off)")
    return int(text)


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
    visible_devices_env = "CUDA_VISIBLE_DEVICES"

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

    @contextlib.contextmanager
    def micro_batches_context(self):
        """cuBLAS instead of cuBLASLt for the two parts' products: cuBLASLt's Hopper kernels hold every
        multiprocessor until they finish, so the other part's NCCL all-reduce waits for them, and split steps
        ran slower than whole ones (benchmarks/RESULTS.md, dual-batch overlap)."""
        library = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublas")
        try:
            yield
        finally:
            torch.backends.cuda.preferred_blas_library(library)

    def capability(self, index: int | None = None) -> tuple[int, int]:
        """The compute capability of device ``index`` (None: the current one), e.g. ``(9, 0)`` on Hopper."""
        return torch.cuda.get_device_capability(index)

    def supports_pdl(self, index: int | None = None) -> bool:
        """Programmatic dependent launch: Hopper (sm_90) and newer."""
        return self.capability(index)[0] >= 9

    def default_batch_limits(self, usage: str) -> tuple[int, int]:
        """vLLM's rule: on devices of 70 GiB or more (not the A100, whose throughput drops with larger
        budgets) 16384 batched tokens offline and 8192 when serving, with up to 1024 sequences.

        The first visible GPU is read through NVML: the engine's process, which drives worker processes
        under tensor parallelism, then opens no CUDA context (it would hold memory on that GPU for nothing).
        """
        visible = cuda_probe.find_devices().visible
        if visible:
            memory, name = visible[0].memory_total, visible[0].name
        else:  # a MIG slice, which NVML does not list as a GPU
            memory, name = self.memory_total(0), torch.cuda.get_device_name(0)
        if memory >= 70 * 2**30 and "a100" not in name.lower():
            return (16384 if usage == "llm" else 8192), 1024
        return super().default_batch_limits(usage)

    def copy_to_host_async(self, tensor: torch.Tensor) -> HostCopy:
        return _CudaHostCopy(tensor)

    # -- numerics ------------------------------------------------------------------------

    def supported_dtypes(self) -> list[torch.dtype]:
        if self.capability() >= (8, 0):
            return [torch.bfloat16, torch.float16, torch.float32]
        return [torch.float16, torch.float32]

    def fused_ops(self):
        """The core's Triton fused ops; on Hopper, 16-bit linears of up to :func:`gemv_max_rows` tokens on the
        Triton GEMV, which beat cuBLAS there at one token, and gate/up projections of up to
        :func:`gated_gemv_max_rows` tokens on the gated GEMV (benchmarks/RESULTS.md, Kernels)."""
        ops = super().fused_ops()
        if self.capability(None)[0] == 9 and hasattr(ops, "gemv_max_rows"):
            ops.gemv_max_rows = gemv_max_rows()
            ops.gated_gemv_max_rows = gated_gemv_max_rows()
        return ops

    def all_reduce_kernel(self, group, device):
        """Decode-sized bfloat16 all-reduces through torch symmetric memory where ``DOVETAIL_ALL_REDUCE`` (default
        ``auto``: the ranks' GPUs all joined by NVLink on one host) says so; NCCL otherwise
        (:mod:`dovetail_cuda.symm_mem_all_reduce`)."""
        from dovetail_cuda.symm_mem_all_reduce import all_reduce_kernel

        return all_reduce_kernel(group, device)

    def quant_kernels(self):
        """On sm89+ (Ada, Hopper): FP8 on a CUDA C++ GEMV (one token), a Triton GEMV (up to 16) or
        ``_scaled_mm``, INT8 ``_int_mm``, Triton for 4/8-bit."""
        if self.capability() >= (8, 9):
            from dovetail_cuda.quant_kernels import CudaQuantKernels

            return CudaQuantKernels()
        return super().quant_kernels()

    # -- engine integration ----------------------------------------------------------------

    def default_attention_backends(self) -> list[str]:
        """Fastest first where measured (:data:`HOPPER_ATTENTION_ORDER`), else FlashAttention first."""
        hopper = visible_capability_major() == 9
        return list(HOPPER_ATTENTION_ORDER if hopper else UNMEASURED_ATTENTION_ORDER)

    def attention_backend_order_reason(self) -> str:
        major = visible_capability_major()
        if major == 9:
            return HOPPER_ORDER_REASON
        gpu = f"sm_{major}x" if major is not None else "these GPUs"
        return f"not measured on {gpu}: FLASH_ATTN, FLASHINFER, TRITON, in vLLM's order of preference"

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
