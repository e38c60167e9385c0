"""The ``xpu`` platform: Intel GPUs through upstream PyTorch's ``torch.xpu`` (no IPEX).

Attention runs through the core's ``TRITON`` backend (PyTorch's XPU wheels ship
Triton for Intel GPUs) or ``REFERENCE``; torch.distributed uses ``xccl``. The
device count comes from the probe (sysfs plus ``ZE_AFFINITY_MASK``), so
constructing the platform starts nothing; memory queries call ``torch.xpu`` and
start the runtime.
"""

from __future__ import annotations

import logging

import torch

from dovetail.platform import Platform, ProbeResult
from dovetail_xpu import probe as xpu_probe

logger = logging.getLogger("dovetail")

VERIFICATION = (
    "NOT verified on hardware: no Intel GPU was available. Tested on CPU up to the probe boundary (a "
    "simulated /sys/class/drm tree, ZE_AFFINITY_MASK, torch._C._has_xpu): probing, device counting, "
    "selection, config adjustments and the KV-cache budget arithmetic. Never executed: every torch.xpu "
    "call (memory queries, set_device, synchronize), the core's Triton kernels (attention, fused ops) on "
    "an Intel GPU, xccl through torch.distributed."
)


class XpuPlatform(Platform):
    """Intel Arc, Flex and Data Center GPU Max under upstream torch.xpu; eager execution only."""

    name = "xpu"
    device_type = "xpu"
    verification = VERIFICATION
    dist_backend = "xccl"
    is_accelerator = True
    supports_graph_capture = False

    def __init__(self):
        self.devices = xpu_probe.find_devices()

    @classmethod
    def probe(cls) -> ProbeResult:
        return xpu_probe.probe()

    # -- devices and memory ------------------------------------------------------------

    def device_count(self) -> int:
        return len(self.devices.visible)

    def set_device(self, index: int = 0) -> None:
        torch.xpu.set_device(index)

    def memory_total(self, index: int = 0) -> int:
        return torch.xpu.mem_get_info(index)[1]

    def memory_free(self, index: int = 0) -> int:
        return torch.xpu.mem_get_info(index)[0]

    def memory_stats(self, index: int = 0) -> dict[str, int]:
        return {"allocated": torch.xpu.memory_allocated(index),
                "peak_allocated": torch.xpu.max_memory_allocated(index),
                "reserved": torch.xpu.memory_reserved(index)}

    def reset_peak_memory_stats(self, index: int = 0) -> None:
        torch.xpu.reset_peak_memory_stats(index)

    def synchronize(self) -> None:
        torch.xpu.synchronize()

    def empty_cache(self) -> None:
        torch.xpu.empty_cache()

    # -- numerics ------------------------------------------------------------------------

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    def resolve_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """Half-precision checkpoints keep their dtype; float32 (or unknown) ones run in bfloat16."""
        if checkpoint_dtype in (torch.float16, torch.bfloat16):
            return checkpoint_dtype
        logger.info("xpu: dtype 'auto' runs the %s checkpoint in bfloat16 (pass dtype='float32' to keep it)",
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
        return ["TRITON", "REFERENCE"]

    def check_and_update_config(self, config) -> None:
        """No graph capture on XPU: run eagerly, and say so once."""
        if not config.device.enforce_eager:
            config.device.enforce_eager = True
            logger.info("xpu: enforce_eager set (decode graphs are not supported on this platform)")

    def describe(self) -> str:
        if self.devices.problem:
            return f"xpu (not usable: {self.devices.problem})"
        return f"xpu ({self.devices.summary()})"
