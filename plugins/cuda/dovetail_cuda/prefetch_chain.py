"""Which weights the next one-token FP8 linear will read, so that the GEMV before it can ask L2 for them.

A decode step runs a model's linears in the same order every time. :class:`PrefetchChain` learns that order
from the calls it sees (each weight's successor is the weight of the call after it) and answers, for the
weight about to be read, a :class:`~dovetail_cuda.fp8_gemv.Prefetch` of its successor's leading bytes. The
engine's warm-up run before each CUDA graph capture teaches it the order, so the captured GEMVs carry their
prefetches. Entries hold weak references: a weight freed (a model dropped) is never prefetched.

``DOVETAIL_CUDA_FP8_PREFETCH_MB`` bounds the bytes prefetched per GEMV (0 turns prefetching off);
``DOVETAIL_CUDA_FP8_PREFETCH_POLICY`` is ``normal`` or ``evict_last`` (the L2 priority of prefetched lines).
"""

from __future__ import annotations

import os
import weakref

import torch

from dovetail.errors import ConfigError
from dovetail_cuda.fp8_gemv import Prefetch, prefetch_of

#: Bytes prefetched per GEMV unless ``DOVETAIL_CUDA_FP8_PREFETCH_MB`` says otherwise.
DEFAULT_MB = 16
POLICIES = ("normal", "evict_last")


def prefetch_settings() -> tuple[int, bool]:
    """(bytes per GEMV, evict-last) from ``DOVETAIL_CUDA_FP8_PREFETCH_MB`` and ``DOVETAIL_CUDA_FP8_PREFETCH_POLICY``."""
    raw = os.environ.get("DOVETAIL_CUDA_FP8_PREFETCH_MB", str(DEFAULT_MB)).strip()
    try:
        megabytes = float(raw)
    except ValueError:
        megabytes = -1.0
    if not megabytes >= 0:
        raise ConfigError(f"DOVETAIL_CUDA_FP8_PREFETCH_MB={raw!r}: expected a number of MiB >= 0 (0: off)")
    policy = os.environ.get("DOVETAIL_CUDA_FP8_PREFETCH_POLICY", "normal").strip().lower()
    if policy not in POLICIES:
        raise ConfigError(f"DOVETAIL_CUDA_FP8_PREFETCH_POLICY={policy!r}: expected one of {POLICIES}")
    return int(megabytes * (1 << 20)), policy == "evict_last"


class PrefetchChain:
    """The order of one-token FP8 linears, learnt from the calls, as prefetches of each weight's successor."""

    def __init__(self, limit: int, evict_last: bool = False):
        self.limit = limit
        self.evict_last = evict_last
        self._successor: dict[int, tuple[weakref.ref, weakref.ref, Prefetch]] = {}
        self._previous: weakref.ref | None = None

    def next_for(self, weight: torch.Tensor, gated: bool) -> Prefetch | None:
        """Record that ``weight`` (read ``gated`` or not) follows the previous call's weight; return the prefetch of
        the weight that followed ``weight`` last time, or None (off, not seen yet, or freed since)."""
        if not self.limit:
            return None
        previous = self._previous() if self._previous is not None else None
        if previous is not None and previous is not weight:
            self._successor[previous.data_ptr()] = (self._previous, weakref.ref(weight),
                                                    prefetch_of(weight, gated, self.limit, self.evict_last))
        self._previous = weakref.ref(weight)
        entry = self._successor.get(weight.data_ptr())
        if entry is None or entry[0]() is not weight or entry[1]() is None:
            return None
        return entry[2]
