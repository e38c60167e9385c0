"""When a rank's host reached each point of its steps: to tell whom a stalled step waited for.

While on, a rank notes the time (``time.perf_counter``, the host's monotonic clock, so every process of the
host reads the same one) at which each step call arrives (``execute``), its kernels are launched
(``launched``), the call for the oldest step's tokens arrives (``take``) and those tokens are on the host
(``tokens``). A stall then shows as the longest gap between two marks: ``take`` to ``tokens`` is the device
(or the peer rank it waits for in a collective), ``tokens`` to the next ``execute`` the engine's process,
``execute`` to ``launched`` the rank's own host work. Python's garbage collections are marked too
(``collect`` to ``collected``). ``dovetail bench throughput --step-stats`` turns it on.
"""

from __future__ import annotations

import gc
import time


class StepTimeline:
    """One process's marks, ``(name, seconds)``, kept only between :meth:`start` and :meth:`stop`."""

    def __init__(self):
        self.marks: list[tuple[str, float]] | None = None

    def start(self) -> None:
        self.marks = []
        if self._collection not in gc.callbacks:
            gc.callbacks.append(self._collection)

    def stop(self) -> list[tuple[str, float]]:
        if self._collection in gc.callbacks:
            gc.callbacks.remove(self._collection)
        marks, self.marks = self.marks or [], None
        return marks

    def _collection(self, phase: str, info: dict) -> None:
        self.mark("collect" if phase == "start" else "collected")

    def mark(self, name: str) -> None:
        if self.marks is not None:
            self.marks.append((name, time.perf_counter()))


def longest_gap(marks: list[tuple[str, float]], start: float, end: float) -> tuple[str, str, float] | None:
    """The longest interval between two consecutive marks that overlaps ``[start, end]``: (from, to, seconds)."""
    best = None
    for (a, ta), (b, tb) in zip(marks, marks[1:]):
        if tb > start and ta < end and (best is None or tb - ta > best[2]):
            best = (a, b, tb - ta)
    return best
