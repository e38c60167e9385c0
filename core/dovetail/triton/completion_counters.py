"""Counters with which the programs of a split launch find the last of them to finish.

A kernel that splits one output over several programs (the GEMV's K slices, decode attention's KV splits)
can merge the parts in the same launch instead of a second kernel: each program stores its part, adds one
to the counter of its output, and the program that sees the count reach the number of parts merges them
and sets the counter back to zero for the next launch. The counters are int32 zeros kept per device and
per kernel, so launches of one kernel must not run at once on different streams of a device.
"""

from __future__ import annotations

import torch

#: By (kernel, device): the counters made so far, the largest last.
_held: dict[tuple[str, torch.device], list[torch.Tensor]] = {}


def completion_counters(kernel: str, device: torch.device, count: int) -> torch.Tensor:
    """At least ``count`` int32 zeros for ``kernel``'s launches on ``device`` (each launch leaves them at zero).

    Made on the kernel's first split launch (the engine's warm-up, before graph capture); a larger one, when
    needed, leaves the older in place for the graphs that captured it.
    """
    held = _held.setdefault((kernel, device), [])
    if not held or held[-1].numel() < count:
        held.append(torch.zeros(max(count, 1 << 16), dtype=torch.int32, device=device))
    return held[-1]


def all_counters() -> list[torch.Tensor]:
    """Every counter tensor made so far (tests check that launches leave them at zero)."""
    return [counters for held in _held.values() for counters in held]
