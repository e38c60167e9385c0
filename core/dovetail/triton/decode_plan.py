"""Decode attention split by work: each sequence's keys cut into as many parts as its length needs.

A split decode launch with one split count for every sequence (``num_splits``) cuts a short sequence as finely as
a long one, and an unsplit launch over sequences of uneven lengths leaves most of the device idle while the
longest finish. A plan instead gives sequence ``i`` ``parts[i]`` programs per KV head, so that no program reads
much more than ``work`` key tiles, with at most ``num_rows`` programs per KV head in all: row ``r`` of the plan
is ``(sequence, part, parts)``, or ``(-1, 0, 1)`` for an unused row. The launch's size depends only on
``num_rows``, so a device graph replays a new plan written into the same buffers.

The plan is made on the host from the host's sequence lengths, longest first (the order
:mod:`dovetail.triton.paged_attention` gives decode programs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

#: The most parts one sequence is cut into (the merge kernel's bound).
MAX_PARTS = 16


@dataclass(frozen=True)
class DecodePlan:
    """A plan on the device: ``rows`` int32 ``[num_rows, 3]`` (sequence, part, parts), ``firsts`` int32
    ``[num_seqs, 2]`` (a sequence's first row, its number of parts)."""

    rows: torch.Tensor
    firsts: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]


def plan_rows(num_seqs: int, num_kv_heads: int, multiprocessors: int, programs_per_multiprocessor: int = 4) -> int:
    """Rows (programs per KV head) of the plan for ``num_seqs`` decodes: room for every sequence twice, and for
    the device's resident programs ``programs_per_multiprocessor`` times over."""
    fill = -(-multiprocessors * programs_per_multiprocessor // max(1, num_kv_heads))
    return max(2 * num_seqs, fill, 1)


def plan_parts(seq_lens: np.ndarray, order: np.ndarray, tile_n: int, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The host's plan: ``rows`` int32 ``[num_rows, 3]`` and ``firsts`` int32 ``[len(seq_lens), 2]`` (see the
    module docstring) for sequences of ``seq_lens`` keys, their rows in ``order`` (a permutation)."""
    n = len(seq_lens)
    if num_rows < n:
        raise ValueError(f"num_rows: a plan of {n} sequences needs at least {n} rows, got {num_rows}")
    tiles = np.maximum(-(-seq_lens.astype(np.int64) // tile_n), 1)
    parts = np.ones(n, dtype=np.int64)
    if num_rows > n and n:
        work = max(1.0, tiles.sum() / num_rows)
        while True:  # the smallest part (in tiles) whose plan fits the rows, from the even share up
            parts = np.minimum(np.minimum(-(-tiles // int(np.ceil(work))), MAX_PARTS), tiles)
            if parts.sum() <= num_rows:
                break
            work *= 1.25
    ordered = parts[order]
    starts = np.concatenate(([0], np.cumsum(ordered)[:-1])) if n else np.zeros(0, dtype=np.int64)
    rows = np.zeros((num_rows, 3), dtype=np.int32)
    rows[:, 0] = -1
    rows[:, 2] = 1
    used = int(ordered.sum())
    rows[:used, 0] = np.repeat(order, ordered)
    rows[:used, 1] = np.arange(used) - np.repeat(starts, ordered)
    rows[:used, 2] = np.repeat(ordered, ordered)
    firsts = np.empty((n, 2), dtype=np.int32)
    firsts[order, 0] = starts
    firsts[:, 1] = parts
    return rows, firsts
