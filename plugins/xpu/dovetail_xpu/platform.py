"""The ``xpu`` platform: Intel GPUs through upstream PyTorch's ``torch.xpu`` (no IPEX).

Attention runs through the core's ``TRITON`` backend (PyTorch's XPU wheels ship
Triton for Intel GPUs) or ``REFERENCE``; torch.distributed uses ``xccl``. The
device count comes from the probe (sysfs plus ``ZE_AFFINITY_MASK``), so
constructing the platform starts nothing; memory queries call ``torch.xpu`` and
start the runtime.
"""

from __future__ import annotations

import logging

from dovetail.platform import ProbeResult
from dovetail.torch_device_platform import TorchDevicePlatform
from dovetail_xpu import probe as xpu_probe

logger = logging.getLogger("dovetail")

VERIFICATION = (
    "NOT verified on hardware: no Intel GPU was available. Tested on CPU up to the probe boundary (a "
    "simulated /sys/class/drm tree, ZE_AFFINITY_MASK, torch._C._has_xpu): probing, device counting, "
    "selection, config adjustments and the KV-cache budget arithmetic. Never executed: every torch.xpu "
    "call (memory queries, set_device, synchronize), the core's Triton kernels (attention, fused ops) on "
    "an Intel GPU, xccl through torch.distributed."
)


class XpuPlatform(TorchDevicePlatform):
    """Intel Arc, Flex and Data Center GPU Max under upstream torch.xpu; eager execution only."""

    name = "xpu"
    device_type = "xpu"
    verification = VERIFICATION
    dist_backend = "xccl"
    supports_graph_capture = False

    def __init__(self):
        self.devices = xpu_probe.find_devices()

    @classmethod
    def probe(cls) -> ProbeResult:
        return xpu_probe.probe()

    # -- devices and memory ------------------------------------------------------------

    def device_count(self) -> int:
        return len(self.devices.visible)

    def multiprocessor_count(self, index: int | None = None) -> int:
        """The device's subslices (Xe cores), over which a kernel's work-groups spread."""
        import torch

        props = torch.xpu.get_device_properties(torch.xpu.current_device() if index is None else index)
        return int(getattr(props, "gpu_subslice_count", 0))

    # -- engine integration ----------------------------------------------------------------

    def default_attention_backends(self) -> list[str]:
        return ["TRITON", "REFERENCE"]

    def attention_backend_order_reason(self) -> str:
        return "TRITON is the only backend for Intel GPUs besides the REFERENCE oracle (not measured)"

    def check_and_update_config(self, config) -> None:
        """No graph capture on XPU: run eagerly, and say so once."""
        if not config.device.enforce_eager:
            config.device.enforce_eager = True
            logger.info("xpu: enforce_eager set (decode graphs are not supported on this platform)")

    def describe(self) -> str:
        if self.devices.problem:
            return f"xpu (not usable: {self.devices.problem})"
        return f"xpu ({self.devices.summary()})"
