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

from dovetail.errors import ConfigError
from dovetail.platform import ProbeResult
from dovetail.torch_device_platform import TorchDevicePlatform
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


class RocmPlatform(TorchDevicePlatform):
    """AMD Instinct and Radeon GPUs under ROCm; the probe reads sysfs and never starts HIP."""

    name = "rocm"
    device_type = "cuda"
    verification = VERIFICATION
    dist_backend = "nccl"
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

    # -- engine integration ----------------------------------------------------------------

    def default_attention_backends(self) -> list[str]:
        if aiter_unavailable_reason() is None:
            return [AITER_BACKEND, "TRITON", "REFERENCE"]
        return ["TRITON", "REFERENCE"]

    def attention_backend_order_reason(self) -> str:
        return ("not measured (no AMD GPU was available): ROCM_AITER first when aiter is installed, as vLLM on ROCm "
                "prefers it, then TRITON")

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

    def describe(self) -> str:
        if self.devices.problem:
            return f"rocm (not usable: {self.devices.problem})"
        return f"rocm ({self.devices.summary()})"
