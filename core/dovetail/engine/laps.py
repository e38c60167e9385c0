"""Timing a start-up's phases one after another."""

from __future__ import annotations

import time


class Laps:
    """Seconds between successive marks, by the name given at each mark (after ``earlier``'s, if given)."""

    def __init__(self, earlier: dict[str, float] | None = None):
        self.seconds: dict[str, float] = dict(earlier or {})
        self.started = self._last = time.monotonic()

    def mark(self, name: str) -> None:
        now = time.monotonic()
        self.seconds[name] = now - self._last
        self._last = now
