"""Whether the ``cuda`` platform is usable here, found without initialising CUDA in this process.

The probe reads ``torch.version.cuda`` (is this torch a CUDA build), asks NVML
for the GPUs (:mod:`dovetail_cuda.nvml`), and applies ``CUDA_VISIBLE_DEVICES``
as the CUDA runtime would: indices or (possibly abbreviated) ``GPU-`` UUIDs,
read up to the first entry that names no GPU. It never calls ``torch.cuda``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

from dovetail.platform import ProbeResult
from dovetail_cuda.nvml import GpuInfo, Nvml, NvmlError


def visible_gpus(gpus: list[GpuInfo], env: Mapping[str, str]) -> tuple[list[GpuInfo], int]:
    """The GPUs ``CUDA_VISIBLE_DEVICES`` leaves visible, in its order, and how many MIG entries it names."""
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return list(gpus), 0
    chosen: list[GpuInfo] = []
    mig = 0
    for item in (part.strip() for part in raw.split(",")):
        if item.startswith("MIG-"):
            mig += 1
            continue
        match = None
        if item.isdigit():
            match = gpus[int(item)] if int(item) < len(gpus) else None
        elif item:
            prefix = item if item.startswith("GPU-") else f"GPU-{item}"
            found = [g for g in gpus if g.uuid.startswith(prefix)]
            match = found[0] if len(found) == 1 else None
        if match is None or match in chosen:
            break
        chosen.append(match)
    return chosen, mig


@dataclass
class CudaDevices:
    """What the probe found: torch's CUDA version, the GPUs present and visible, and why none is usable."""

    torch_cuda: str | None
    driver: str = ""
    present: list[GpuInfo] = field(default_factory=list)
    visible: list[GpuInfo] = field(default_factory=list)
    mig: int = 0
    problem: str = ""

    def summary(self) -> str:
        kinds: dict[str, int] = {}
        for gpu in self.visible:
            key = f"{gpu.name} (sm_{gpu.capability[0]}{gpu.capability[1]}, {gpu.memory_total / 2**30:.0f} GiB)"
            kinds[key] = kinds.get(key, 0) + 1
        text = ", ".join(f"{n} x {k}" for k, n in kinds.items())
        if self.mig:
            text = ", ".join(filter(None, [text, f"{self.mig} MIG instance(s)"]))
        hidden = len(self.present) - len(self.visible)
        if hidden and not self.mig:
            text += f", {hidden} hidden by CUDA_VISIBLE_DEVICES"
        return f"{text}; driver {self.driver}, torch CUDA {self.torch_cuda}"


def _torch_build() -> tuple[str | None, str]:
    from torch import version

    cuda = getattr(version, "cuda", None)
    if cuda:
        return cuda, ""
    hip = getattr(version, "hip", None)
    kind = f"a ROCm {hip} build" if hip else "a CPU-only build"
    return None, (f"this torch is {kind} (torch.version.cuda is not set); install a CUDA build of torch "
                  "(https://pytorch.org/get-started/locally/)")


def find_devices(nvml_factory=Nvml, env: Mapping[str, str] | None = None) -> CudaDevices:
    """Inspect this machine; see the module docstring for what is read."""
    env = os.environ if env is None else env
    cuda, build_problem = _torch_build()
    try:
        with nvml_factory() as nvml:
            present, driver = nvml.gpus(), nvml.driver_version()
    except NvmlError as exc:
        problem = f"no NVIDIA driver: {exc}"
        return CudaDevices(cuda, problem=f"{problem}; and {build_problem}" if build_problem else problem)
    visible, mig = visible_gpus(present, env)
    devices = CudaDevices(cuda, driver, present, visible, mig)
    if not present:
        devices.problem = "the NVIDIA driver reports no GPU"
    elif not visible and not mig:
        devices.problem = (f"{len(present)} NVIDIA GPU(s) present but none visible with "
                           f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r}")
    elif build_problem:
        devices.problem = build_problem
    return devices


def probe() -> ProbeResult:
    """The registered probe of the ``cuda`` platform."""
    devices = find_devices()
    if devices.problem:
        return ProbeResult.no(devices.problem)
    return ProbeResult.ok(devices.summary())
