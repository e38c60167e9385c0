"""How many compute units a device's launches spread over: the core's Triton kernels size their grids by it."""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("dovetail")

_SM_COUNT: dict[torch.device, int] = {}


def multiprocessor_count(device: torch.device) -> int:
    """The compute units a launch on ``device`` spreads over, as its platform says (``Platform.multiprocessor_count``;
    the CPU's cores for triton's interpreter); 64 where unknown. Asked once per device."""
    if device not in _SM_COUNT:
        count = 0
        if device.type == "cpu":  # the interpreter
            count = os.cpu_count() or 1
        else:
            from dovetail.selection import platform_for_device

            platform = platform_for_device(device.type)
            try:
                count = platform.multiprocessor_count(device.index) if platform is not None else 0
            except Exception:
                logger.warning("the %s platform could not count the multiprocessors of %s; assuming 64",
                               device.type, device, exc_info=True)
        _SM_COUNT[device] = count or 64
    return _SM_COUNT[device]
