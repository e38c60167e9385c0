"""The next product's weight brought into L2 while a tensor-parallel sum crosses NVLink.

In a decode step each row-parallel product is summed over the ranks before the next product can start. The sum
is latency-bound (a few microseconds of flags and peer writes) and hardly touches device memory, while the
product after it is bound by reading its weight from that memory. :class:`L2Prefetch` puts the idle memory to
work: beside the sum, on a side stream, one small kernel asks L2 for the first bytes of the next product's
weight (Hopper's bulk prefetch, ``cp.async.bulk.prefetch.L2``; the requests complete after the kernel has
exited), and the product finds them there. It changes no value, only where the weight's first bytes are read
from.

``DOVETAIL_L2_PREFETCH_MB`` sets how much of each weight (default :data:`DEFAULT_MB`; 0 turns it off). Only
CUDA-graph captures prefetch (decode steps): prefill's products are bound by arithmetic, not by their weights.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dovetail.errors import ConfigError

ENV = "DOVETAIL_L2_PREFETCH_MB"
#: Megabytes of each weight prefetched: an H100's 50 MB L2 holds them beside the sum's buffers.
DEFAULT_MB = 32
#: Bytes one prefetch instruction asks for.
SEGMENT = 16 << 10
_BLOCK = 128


@triton.jit
def _l2_prefetch_kernel(base_ptr, segment_bytes, segments, BLOCK: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = index < segments
    address = base_ptr + tl.where(valid, index, 0).to(tl.int64) * segment_bytes
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
        "=r,l,r,r", [address, valid.to(tl.int32), segment_bytes + tl.zeros_like(index)], dtype=tl.int32,
        is_pure=False, pack=1)


def prefetch_mb() -> int:
    """``DOVETAIL_L2_PREFETCH_MB``: megabytes of each next weight to prefetch (0: none)."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_MB
    if not raw.isdigit():
        raise ConfigError(f"{ENV}={raw!r}: expected a whole number of megabytes (0 turns prefetching off)")
    return int(raw)


def prefetch_into_l2(tensor: torch.Tensor, max_bytes: int) -> None:
    """Ask L2 for the first ``max_bytes`` of ``tensor``'s storage (whole :data:`SEGMENT` units), without waiting."""
    flat = tensor.detach().view(-1).view(torch.uint8)
    segments = min(max_bytes, flat.numel()) // SEGMENT
    if segments:
        _l2_prefetch_kernel[(triton.cdiv(segments, _BLOCK),)](flat, SEGMENT, segments, BLOCK=_BLOCK, num_warps=4)


class L2Prefetch:
    """Prefetches a weight on a side stream of ``device``, inside CUDA-graph captures only; does nothing off Hopper
    and newer GPUs or with 0 bytes.

    The current stream joins the side stream only at the next :meth:`start` or :meth:`join`, so the prefetch kernel
    (its bulk requests take a while to issue) never holds up the sum or the product after it; the caller joins
    before a capture ends (the last norm of a forward, which names no next product, does)."""

    def __init__(self, device: torch.device, max_bytes: int | None = None):
        self.device = device
        self.max_bytes = prefetch_mb() << 20 if max_bytes is None else max_bytes
        if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:  # an sm_90 instruction
            self.max_bytes = 0
        self._side: torch.cuda.Stream | None = None
        self._pending = False

    def start(self, weight: torch.Tensor | None) -> bool:
        """Join an earlier prefetch, fork the side stream from the current one and prefetch ``weight`` there; True
        when it did."""
        self.join()
        if (not self.max_bytes or weight is None or not weight.is_cuda or not weight.is_contiguous()
                or not torch.cuda.is_current_stream_capturing()):
            return False
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            prefetch_into_l2(weight, self.max_bytes)
        self._pending = True
        return True

    def join(self) -> None:
        """Make the current stream wait for the last prefetch kernel, if one is not joined yet."""
        if self._pending:
            torch.cuda.current_stream(self.device).wait_stream(self._side)
            self._pending = False
