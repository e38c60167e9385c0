"""The NVIDIA GPUs of this machine, read through NVML with ctypes.

NVML (``libnvidia-ml.so.1``, installed with the driver) answers without
creating a CUDA context, so asking it never initialises CUDA in this process.
Only the few entry points below are used.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

LIBRARY_NAMES = ("libnvidia-ml.so.1", "libnvidia-ml.so")
#: ``nvmlGpuP2PCapsIndex_t``: whether two GPUs reach each other's memory over NVLink.
P2P_CAPS_INDEX_NVLINK = 2
P2P_STATUS_OK = 0


class NvmlError(Exception):
    """NVML is missing or answered with an error."""


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU as NVML sees it."""

    index: int
    name: str
    uuid: str
    capability: tuple[int, int]
    memory_total: int


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def load_library(names=LIBRARY_NAMES):
    """The NVML shared library, or :class:`NvmlError` saying why it cannot be loaded."""
    first_error = None
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            first_error = first_error or str(exc)
    raise NvmlError(f"NVML ({names[0]}) cannot be loaded: {first_error}")


class Nvml:
    """A session with NVML: ``with Nvml() as nvml: nvml.gpus()``."""

    def __init__(self, library=None):
        self.lib = library if library is not None else load_library()

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            function = getattr(self.lib, "nvmlErrorString", None)
            if isinstance(function, ctypes._CFuncPtr):
                function.restype = ctypes.c_char_p
            text = (function(code) or b"").decode(errors="replace") if function is not None else ""
            raise NvmlError(f"NVML {what} failed with error {code}{': ' + text if text else ''}")

    def __enter__(self) -> "Nvml":
        self._check(self.lib.nvmlInit_v2(), "nvmlInit_v2")
        return self

    def __exit__(self, *exc) -> None:
        self.lib.nvmlShutdown()

    def driver_version(self) -> str:
        buf = ctypes.create_string_buffer(96)
        self._check(self.lib.nvmlSystemGetDriverVersion(buf, ctypes.c_uint(96)), "nvmlSystemGetDriverVersion")
        return buf.value.decode()

    def gpus(self) -> list[GpuInfo]:
        count = ctypes.c_uint(0)
        self._check(self.lib.nvmlDeviceGetCount_v2(ctypes.byref(count)), "nvmlDeviceGetCount_v2")
        return [self._gpu(i) for i in range(count.value)]

    def _gpu(self, index: int) -> GpuInfo:
        handle = ctypes.c_void_p()
        self._check(self.lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)),
                    "nvmlDeviceGetHandleByIndex_v2")
        name, uuid = ctypes.create_string_buffer(96), ctypes.create_string_buffer(96)
        self._check(self.lib.nvmlDeviceGetName(handle, name, ctypes.c_uint(96)), "nvmlDeviceGetName")
        self._check(self.lib.nvmlDeviceGetUUID(handle, uuid, ctypes.c_uint(96)), "nvmlDeviceGetUUID")
        major, minor = ctypes.c_int(0), ctypes.c_int(0)
        self._check(self.lib.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)),
                    "nvmlDeviceGetCudaComputeCapability")
        memory = _Memory()
        self._check(self.lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)), "nvmlDeviceGetMemoryInfo")
        return GpuInfo(index, name.value.decode(), uuid.value.decode(), (major.value, minor.value), memory.total)

    def _handle_by_uuid(self, uuid: str) -> ctypes.c_void_p:
        handle = ctypes.c_void_p()
        self._check(self.lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle)),
                    "nvmlDeviceGetHandleByUUID")
        return handle

    def nvlink_connected(self, uuid: str, peer_uuids: list[str]) -> bool:
        """Whether the GPU ``uuid`` reaches every GPU of ``peer_uuids`` directly over NVLink."""
        handle = self._handle_by_uuid(uuid)
        for peer in peer_uuids:
            if peer == uuid:
                continue
            status = ctypes.c_int(-1)
            self._check(self.lib.nvmlDeviceGetP2PStatus(handle, self._handle_by_uuid(peer),
                                                        ctypes.c_int(P2P_CAPS_INDEX_NVLINK), ctypes.byref(status)),
                        "nvmlDeviceGetP2PStatus")
            if status.value != P2P_STATUS_OK:
                return False
        return True
