"""Dual-batch overlap: a large step as two micro-batches whose collectives overlap each other's compute.

Under tensor parallelism every layer of a prefill chunk ends in an all-reduce of the whole chunk (hundreds of
MiB over NVLink), and the device's compute units idle while it crosses. Split at a request boundary into two
parts of about equal tokens, the step runs each part's forward on its own stream and alternates between them
at every collective (a model's ``forward_steps`` pauses right after issuing one): the collectives are issued
A1 B1 A2 B2 ... on every rank, one order as NCCL requires, and while one part's sum crosses the link the
other part's matrix products run. The parts share no sequence; a step whose second part would read a block
of the KV cache that the first part writes (a prefix-cache hit on a prompt computed in the same step) stays
whole, as the parts' streams do not order one's cache writes before the other's reads.

While the parts are in flight every collective goes through the backend: a platform's own all-reduce kernels
keep one buffer between calls (:func:`dovetail.distributed.backend_collectives`). The two streams are the
current one (the first part) and one more, so the first part allocates from the memory the unsplit steps
use.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Generator, Iterator, Sequence

import torch

from dovetail.forward_context import set_forward_context

#: A model's ``forward_steps(input_ids, positions)``: pauses after each collective, returns the hidden states.
ForwardSteps = Callable[[torch.Tensor, torch.Tensor], Generator[None, None, torch.Tensor]]


def split_point(num_new_tokens: Sequence[int], min_tokens: int) -> int | None:
    """Where a step of requests with ``num_new_tokens`` tokens each splits: the index of the second part's
    first request, at the request boundary nearest half the tokens. None where the step has fewer than
    ``min_tokens`` tokens or either part would hold less than a quarter of them (a step of one long prompt
    stays whole)."""
    total = sum(num_new_tokens)
    if total < min_tokens or len(num_new_tokens) < 2:
        return None
    best, best_gap, first, before = None, total, 0, 0
    for index, tokens in enumerate(num_new_tokens[:-1], start=1):
        before += tokens
        gap = abs(2 * before - total)
        if gap < best_gap:
            best, best_gap, first = index, gap, before
    if min(first, total - first) * 4 < total:
        return None
    return best


def parts_share_blocks(starts: Sequence[int], num_new_tokens: Sequence[int], block_tables: Sequence[Sequence[int]],
                       block_size: int, split: int) -> bool:
    """Whether either part of a step split at ``split`` reads a KV-cache block the other part writes: request
    ``i`` reads its blocks up to its last new token and writes those from ``starts[i]`` (its computed
    tokens) on."""
    def blocks(rows: range, written: bool) -> set[int]:
        found: set[int] = set()
        for i in rows:
            last = (starts[i] + num_new_tokens[i] - 1) // block_size
            found.update(block_tables[i][starts[i] // block_size if written else 0:last + 1])
        return found

    first, second = range(split), range(split, len(starts))
    return bool(blocks(first, True) & blocks(second, False) or blocks(second, True) & blocks(first, False))


@contextlib.contextmanager
def _on_stream(stream: torch.Stream | None) -> Iterator[None]:
    if stream is None:
        yield
        return
    previous = torch.accelerator.current_stream(stream.device)
    torch.accelerator.set_stream(stream)
    try:
        yield
    finally:
        torch.accelerator.set_stream(previous)


def run_interleaved(forward_steps: ForwardSteps, parts: Sequence[tuple[torch.Tensor, torch.Tensor, Any]],
                    side_stream: torch.Stream | None) -> list[torch.Tensor]:
    """The hidden states of each of the two ``parts`` (input ids, positions, attention metadata): the parts'
    ``forward_steps`` advanced in turn from one pause to the next, the first on the current stream and the
    second on ``side_stream`` (None: on the current one too, as on a CPU). The current stream waits for the
    side stream before this returns."""
    first, second = parts
    main = None if side_stream is None else torch.accelerator.current_stream(side_stream.device)
    if main is not None:
        side_stream.wait_stream(main)
    runs = [(forward_steps(ids, positions), metadata, stream)
            for (ids, positions, metadata), stream in ((first, None), (second, side_stream))]
    outputs: list[torch.Tensor | None] = [None, None]
    while any(run is not None for run in runs):
        for index, run in enumerate(runs):
            if run is None:
                continue
            steps, metadata, stream = run
            with _on_stream(stream), set_forward_context(metadata):
                try:
                    next(steps)
                except StopIteration as finished:
                    outputs[index], runs[index] = finished.value, None
    if main is not None:
        main.wait_stream(side_stream)
    return outputs
