"""AMD GPUs as the amdgpu kernel driver (KFD) lists them in sysfs, read without the HIP runtime.

ROCr enumerates GPUs from the same files (libhsakmt's topology code): every
directory under ``nodes/`` is a node, numbered in order; a node whose ``gpu_id``
is 0 is a CPU; a GPU node is only usable when its DRM render node
``/dev/dri/renderD<drm_render_minor>`` can be opened (a container that was not
given that device does not see the GPU). The order of the usable GPU nodes is
the enumeration order that ``ROCR_VISIBLE_DEVICES`` indexes.

The paths are module attributes so that tests can point them at a fake tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

KFD_DEVICE = "/dev/kfd"
KFD_TOPOLOGY_NODES = "/sys/devices/virtual/kfd/kfd/topology/nodes"
DRI_DIR = "/dev/dri"

#: KFD memory-bank heap types that are device memory (HSA_HEAPTYPE_FRAME_BUFFER_PUBLIC / _PRIVATE).
_VRAM_HEAP_TYPES = (1, 2)


@dataclass(frozen=True)
class KfdGpu:
    """One GPU node of the KFD topology."""

    node: int
    gpu_id: int
    gfx_target_version: int
    unique_id: int
    simd_count: int
    drm_render_minor: int
    vram_bytes: int

    @property
    def gfx_arch(self) -> str:
        """The LLVM target name, e.g. ``gfx942`` (from ``gfx_target_version`` = major*10000 + minor*100 + step)."""
        v = self.gfx_target_version
        return f"gfx{v // 10000}{(v // 100) % 100}{v % 100:x}"

    @property
    def uuid(self) -> str | None:
        """``GPU-<16 hex digits>`` as ROCr reports it, or None where the device has no UUID (gfx8)."""
        return f"GPU-{self.unique_id:016x}" if self.unique_id else None


def read_properties(path: str) -> dict[str, int]:
    """A KFD ``properties`` file: one ``name value`` pair per line, values unsigned integers."""
    props: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                props[parts[0]] = int(parts[1])
    return props


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _vram_bytes(node_dir: str) -> int:
    banks_dir = os.path.join(node_dir, "mem_banks")
    total = 0
    for bank in _numbered_subdirs(banks_dir):
        try:
            props = read_properties(os.path.join(banks_dir, str(bank), "properties"))
        except OSError:
            continue
        if props.get("heap_type") in _VRAM_HEAP_TYPES:
            total += props.get("size_in_bytes", 0)
    return total


def _numbered_subdirs(path: str) -> list[int]:
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(int(n) for n in names if n.isdigit())


def render_node_usable(minor: int) -> bool:
    """Whether this process may open ``/dev/dri/renderD<minor>`` (checked with access(), not opened)."""
    return os.access(os.path.join(DRI_DIR, f"renderD{minor}"), os.R_OK | os.W_OK)


def topology_readable() -> bool:
    return os.path.isdir(KFD_TOPOLOGY_NODES)


def list_gpus() -> tuple[list[KfdGpu], list[str]]:
    """The usable GPU nodes in enumeration order, and a note for each GPU node that was skipped."""
    gpus: list[KfdGpu] = []
    skipped: list[str] = []
    for node in _numbered_subdirs(KFD_TOPOLOGY_NODES):
        node_dir = os.path.join(KFD_TOPOLOGY_NODES, str(node))
        gpu_id = _read_int(os.path.join(node_dir, "gpu_id"))
        if not gpu_id:
            continue
        try:
            props = read_properties(os.path.join(node_dir, "properties"))
        except OSError as exc:
            skipped.append(f"KFD node {node}: properties unreadable ({exc.strerror})")
            continue
        if props.get("simd_count", 0) == 0:
            continue
        minor = props.get("drm_render_minor", 0)
        if not minor or not render_node_usable(minor):
            skipped.append(f"KFD node {node}: {os.path.join(DRI_DIR, f'renderD{minor}')} is not accessible")
            continue
        gpus.append(KfdGpu(node=node, gpu_id=gpu_id, gfx_target_version=props.get("gfx_target_version", 0),
                           unique_id=props.get("unique_id", 0), simd_count=props["simd_count"],
                           drm_render_minor=minor, vram_bytes=_vram_bytes(node_dir)))
    return gpus, skipped
