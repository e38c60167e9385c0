"""The next product's weight brought into L2 while a tensor-parallel sum crosses NVLink.

In a decode step each row-parallel product is summed over the ranks before the next product can start. The sum
is latency-bound (a few microseconds of flags and peer writes) and hardly touches device memory, while the
product after it is bound by reading its weight from that memory. :func:`prefetch_row_prefixes` puts the idle
memory to work: on the sum's own stream, just before it, one small kernel asks L2 for the first bytes of every
row of the next product's weight (Hopper's bulk prefetch, ``cp.async.bulk.prefetch.L2``; the requests complete
after the kernel has exited), and launches the sum at once (programmatic dependent launch). Every program of
the product starts its loop over K at the rows' first bytes, so each finds its first tiles in L2; a prefix of
the whole weight instead would serve a few programs while the rest waited on memory as before. It changes no
value, only where those bytes are read from.

``DOVETAIL_L2_PREFETCH_MB`` sets how much of each weight (default :data:`DEFAULT_MB`; 0 turns it off). Only
CUDA-graph captures prefetch (decode steps): prefill's products are bound by arithmetic, not by their weights.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dovetail.errors import ConfigError
from dovetail.triton.pdl import launch_kwargs, pdl_prologue, use_pdl

ENV = "DOVETAIL_L2_PREFETCH_MB"
#: Megabytes of each weight prefetched: a fraction of an H100's 50 MB L2, filled within one sum.
DEFAULT_MB = 8
#: The bulk prefetch moves whole 16-byte units; below a 128-byte line a row's prefix saves nothing.
_UNIT, _MIN_PREFIX = 16, 128
_BLOCK = 128


@triton.jit
def _l2_prefetch_kernel(base_ptr, row_bytes, prefix_bytes, rows, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = row < rows
    address = base_ptr + tl.where(valid, row, 0).to(tl.int64) * row_bytes
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
        "=r,l,r,r", [address, valid.to(tl.int32), prefix_bytes + tl.zeros_like(row)], dtype=tl.int32,
        is_pure=False, pack=1)


def prefetch_mb() -> int:
    """``DOVETAIL_L2_PREFETCH_MB``: megabytes of each next weight to prefetch (0: none)."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_MB
    if not raw.isdigit():
        raise ConfigError(f"{ENV}={raw!r}: expected a whole number of megabytes (0 turns prefetching off)")
    return int(raw)


def row_prefix_bytes(weight: torch.Tensor, max_bytes: int) -> int:
    """Bytes to prefetch from the start of each row of a 2-D ``weight`` so that all rows take at most
    ``max_bytes``: whole 16-byte units, no more than a row; 0 where that is under a 128-byte line."""
    if weight.dim() != 2 or not weight.is_contiguous() or weight.shape[0] == 0:
        return 0
    row_bytes = weight.shape[1] * weight.element_size()
    prefix = min(row_bytes, max_bytes // weight.shape[0]) // _UNIT * _UNIT
    return prefix if prefix >= _MIN_PREFIX and row_bytes % _UNIT == 0 else 0


def prefetch_row_prefixes(weight: torch.Tensor, max_bytes: int) -> bool:
    """Ask L2 for the first bytes of every row of ``weight`` (:func:`row_prefix_bytes`), without waiting for
    them, on the current stream; False where there is nothing to prefetch."""
    prefix = row_prefix_bytes(weight, max_bytes)
    if not prefix:
        return False
    rows, row_bytes = weight.shape[0], weight.shape[1] * weight.element_size()
    _l2_prefetch_kernel[(triton.cdiv(rows, _BLOCK),)](weight.detach().view(torch.uint8), row_bytes, prefix, rows,
                                                      BLOCK=_BLOCK, num_warps=4, **launch_kwargs(use_pdl(weight.device)))
    return True


class L2Prefetch:
    """Prefetches the first bytes of a weight's rows just before work that leaves device memory idle, inside
    CUDA-graph captures only; does nothing off Hopper and newer GPUs or with 0 bytes."""

    def __init__(self, device: torch.device, max_bytes: int | None = None):
        self.device = device
        self.max_bytes = prefetch_mb() << 20 if max_bytes is None else max_bytes
        if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:  # an sm_90 instruction
            self.max_bytes = 0

    def before(self, weight: torch.Tensor | None) -> bool:
        """Prefetch ``weight``'s row prefixes on the current stream if a graph is being captured; True when it did."""
        if (not self.max_bytes or weight is None or not weight.is_cuda or weight.device != self.device
                or not torch.cuda.is_current_stream_capturing()):
            return False
        return prefetch_row_prefixes(weight, self.max_bytes)
