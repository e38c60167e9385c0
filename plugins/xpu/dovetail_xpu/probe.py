"""Whether the ``xpu`` platform is usable here, found without starting the SYCL / Level Zero runtime.

Which ``torch.xpu`` calls start the runtime (read in torch 2.13's ``torch/xpu``):

- ``torch.xpu._is_compiled()`` reads ``torch._C._has_xpu``, a build-time flag:
  nothing starts. The probe uses only this from torch.
- ``torch.xpu.device_count()`` / ``is_available()`` count through Level Zero
  Sysman when the optional ``pyzes`` package imports (``zesInit``, which does not
  start SYCL), and otherwise call ``torch._C._xpu_getDeviceCount()``, which
  enumerates SYCL devices and so starts the runtime in this process (a later
  ``fork`` is then unsafe). The probe does not call them.
- ``get_device_properties``, ``mem_get_info``, ``set_device``, ``synchronize`` and
  every allocation call ``_lazy_init()``: full initialisation. Only the
  platform instance calls them, after selection.

Instead the probe reads sysfs: an Intel GPU is a DRM render node
``/sys/class/drm/renderD*`` whose PCI ``device/vendor`` is ``0x8086`` and whose
kernel driver is ``i915`` or ``xe``, and whose ``/dev/dri/renderD*`` this process
may open. Devices are numbered in PCI-address order (an assumption: Level Zero's
own order is not visible without the runtime). ``ZE_AFFINITY_MASK`` then
selects among them (see :func:`apply_affinity_mask`).

Limits, stated rather than guessed: a multi-tile GPU (Data Center GPU Max) in
Level Zero's default FLAT hierarchy is several devices to the runtime but one
render node here; and torch prefers discrete GPUs over an integrated one when
both exist, which sysfs cannot tell apart reliably. In those cases the runtime's
count differs from the probe's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from dovetail.platform import ProbeResult

DRM_SYSFS = "/sys/class/drm"
DRI_DIR = "/dev/dri"
INTEL_VENDOR_ID = 0x8086
INTEL_GPU_DRIVERS = ("i915", "xe")


@dataclass(frozen=True)
class IntelGpu:
    """One Intel GPU render node."""

    render_node: str  # e.g. "renderD128"
    pci_address: str  # e.g. "0000:03:00.0"
    device_id: int
    driver: str


@dataclass
class XpuDevices:
    """What the probe found: the GPUs present, those visible under ``ZE_AFFINITY_MASK``, and why none is."""

    present: list[IntelGpu] = field(default_factory=list)
    visible: list[IntelGpu] = field(default_factory=list)
    problem: str = ""

    def summary(self) -> str:
        ids = ", ".join(f"{g.render_node} (device 0x{g.device_id:04x}, {g.driver})" for g in self.visible)
        hidden = len(self.present) - len(self.visible)
        extra = f"; {hidden} hidden by ZE_AFFINITY_MASK={os.environ.get('ZE_AFFINITY_MASK')!r}" if hidden else ""
        return f"{len(self.visible)} visible Intel GPU(s): {ids}{extra}"


def _read_hex(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip(), 16)
    except (OSError, ValueError):
        return None


def list_intel_gpus() -> list[IntelGpu]:
    """Intel GPU render nodes this process may open, in PCI-address order."""
    try:
        names = sorted(n for n in os.listdir(DRM_SYSFS) if n.startswith("renderD"))
    except OSError:
        return []
    gpus = []
    for name in names:
        device_dir = os.path.join(DRM_SYSFS, name, "device")
        if _read_hex(os.path.join(device_dir, "vendor")) != INTEL_VENDOR_ID:
            continue
        driver = os.path.basename(os.path.realpath(os.path.join(device_dir, "driver")))
        if driver not in INTEL_GPU_DRIVERS:
            continue
        if not os.access(os.path.join(DRI_DIR, name), os.R_OK | os.W_OK):
            continue
        gpus.append(IntelGpu(render_node=name, pci_address=os.path.basename(os.path.realpath(device_dir)),
                             device_id=_read_hex(os.path.join(device_dir, "device")) or 0, driver=driver))
    return sorted(gpus, key=lambda g: g.pci_address)


def _c_stoul_prefix(text: str) -> int | None:
    """``std::stoul(text, nullptr, 0)``: the leading number (``0x`` hex, leading-``0`` octal), or None if none."""
    text = text.lstrip(" \t\n\r\f\v")
    negative = text[:1] == "-"
    if text[:1] in ("+", "-"):
        text = text[1:]
    if text[:2].lower() == "0x" and text[2:3] and text[2:3] in "0123456789abcdefABCDEF":
        text, allowed, base = text[2:], "0123456789abcdefABCDEF", 16
    elif text[:1] == "0":
        allowed, base = "01234567", 8
    else:
        allowed, base = "0123456789", 10
    digits = ""
    for c in text:
        if c not in allowed:
            break
        digits += c
    if not digits:
        return None
    value = int(digits, base)
    return (-value) % 2**32 if negative else value % 2**32


def apply_affinity_mask(gpus: list[IntelGpu], mask: str | None, hierarchy: str | None = None) -> list[IntelGpu]:
    """The devices ``ZE_AFFINITY_MASK=mask`` leaves visible (``None``, empty or ``default``: all).

    As Intel's compute runtime parses it (``ExecutionEnvironment::parseAffinityMask``):
    entries are comma-separated; the number before the first ``.`` is read like
    ``std::stoul(entry, nullptr, 0)``; an index past the last device is ignored.
    Under ``ZE_FLAT_DEVICE_HIERARCHY`` ``FLAT`` (the default) or ``COMBINED``,
    indices count tiles and ``N.M`` entries are ignored; under ``COMPOSITE``,
    ``N`` is a whole card and ``N.M`` tile ``M`` of it. Every GPU here is taken
    to have one tile (see the module docstring). Visible devices keep their
    enumeration order. An entry with no leading number, which the runtime
    rejects with an error, is ignored here.
    """
    if mask is None or mask == "" or mask == "default":
        return list(gpus)
    composite = (hierarchy or "FLAT") == "COMPOSITE"
    enabled: set[int] = set()
    for entry in mask.split(","):
        parts = entry.split(".")
        index = _c_stoul_prefix(parts[0])
        if index is None or index >= len(gpus):
            continue
        if len(parts) == 1:
            enabled.add(index)
        elif composite and len(parts) == 2 and _c_stoul_prefix(parts[1]) == 0:
            enabled.add(index)
    return [g for i, g in enumerate(gpus) if i in enabled]


def torch_built_with_xpu() -> bool:
    """``torch._C._has_xpu``: whether this torch was compiled with XPU support (starts nothing)."""
    import torch

    return bool(getattr(torch._C, "_has_xpu", False))


def find_devices() -> XpuDevices:
    """Inspect this machine; see the module docstring for what is read."""
    if not torch_built_with_xpu():
        return XpuDevices(problem="this torch was built without XPU support (torch._C._has_xpu is False); "
                                  "install an XPU build: pip install torch --index-url "
                                  "https://download.pytorch.org/whl/xpu")
    present = list_intel_gpus()
    if not present:
        return XpuDevices(problem=f"no Intel GPU found: no accessible {DRI_DIR}/renderD* node of vendor 0x8086 "
                                  f"driven by {' or '.join(INTEL_GPU_DRIVERS)} (is the GPU driver loaded, and "
                                  "is this user in the 'render' group?)")
    visible = apply_affinity_mask(present, os.environ.get("ZE_AFFINITY_MASK"),
                                  os.environ.get("ZE_FLAT_DEVICE_HIERARCHY"))
    if not visible:
        return XpuDevices(present, problem=f"{len(present)} Intel GPU(s) present but none visible with "
                                           f"ZE_AFFINITY_MASK={os.environ.get('ZE_AFFINITY_MASK')!r}")
    return XpuDevices(present, visible)


def probe() -> ProbeResult:
    """The registered probe of the ``xpu`` platform."""
    devices = find_devices()
    if devices.problem:
        return ProbeResult.no(devices.problem)
    return ProbeResult.ok(devices.summary())
