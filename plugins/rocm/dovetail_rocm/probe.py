"""Whether the ``rocm`` platform is usable here, found without starting HIP in this process.

The probe reads three things and nothing else: ``torch.version.hip`` (is this
torch a ROCm build), the KFD device file and topology in sysfs (which AMD GPUs
the driver exposes, see :mod:`dovetail_rocm.kfd`), and the visibility variables
(see :mod:`dovetail_rocm.visible_devices`). It never calls ``torch.cuda``,
which would initialise HIP and make a later ``fork`` unsafe.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from dovetail.platform import ProbeResult
from dovetail_rocm import kfd
from dovetail_rocm.visible_devices import describe_filters, visible_gpus


@dataclass
class RocmDevices:
    """What the probe found: the HIP version, the GPUs present, those visible, and why none is."""

    hip_version: str | None
    present: list[kfd.KfdGpu] = field(default_factory=list)
    visible: list[kfd.KfdGpu] = field(default_factory=list)
    problem: str = ""

    def summary(self) -> str:
        archs: dict[str, int] = {}
        for gpu in self.visible:
            archs[gpu.gfx_arch] = archs.get(gpu.gfx_arch, 0) + 1
        kinds = ", ".join(f"{n} x {a}" for a, n in archs.items())
        hidden = len(self.present) - len(self.visible)
        extra = f", {hidden} hidden by {describe_filters(os.environ)}" if hidden else ""
        return f"{len(self.visible)} visible GPU(s): {kinds}{extra}; HIP {self.hip_version}"


def find_devices() -> RocmDevices:
    """Inspect this machine; see the module docstring for what is read."""
    from torch import version

    hip = getattr(version, "hip", None)
    if not hip:
        cuda = getattr(version, "cuda", None)
        build = f"a CUDA {cuda} build" if cuda else "a CPU-only build"
        return RocmDevices(None, problem=f"this torch is {build} (torch.version.hip is not set); install a ROCm "
                                         "build of torch (https://pytorch.org/get-started/locally/)")
    if not os.path.exists(kfd.KFD_DEVICE):
        return RocmDevices(hip, problem=f"{kfd.KFD_DEVICE} does not exist: the amdgpu driver is not loaded, or "
                                        "this container was started without --device=/dev/kfd")
    if not os.access(kfd.KFD_DEVICE, os.R_OK | os.W_OK):
        return RocmDevices(hip, problem=f"no read/write permission on {kfd.KFD_DEVICE} (add the user to the "
                                        "'render' and 'video' groups)")
    if not kfd.topology_readable():
        return RocmDevices(hip, problem=f"the KFD topology {kfd.KFD_TOPOLOGY_NODES} is missing")
    present, skipped = kfd.list_gpus()
    if not present:
        why = "; ".join(skipped) or "the KFD topology lists no GPU node"
        return RocmDevices(hip, problem=f"no usable AMD GPU: {why}")
    visible = visible_gpus(present, os.environ)
    if not visible:
        return RocmDevices(hip, present, problem=f"{len(present)} AMD GPU(s) present but none visible with "
                                                 f"{describe_filters(os.environ)}")
    return RocmDevices(hip, present, visible)


def probe() -> ProbeResult:
    """The registered probe of the ``rocm`` platform."""
    devices = find_devices()
    if devices.problem:
        return ProbeResult.no(devices.problem)
    return ProbeResult.ok(devices.summary())
