"""Python's full garbage collections kept off the long-lived heap while an engine generates.

A full collection walks every object the collector tracks. Once torch, transformers and a model are imported and
built, that is hundreds of thousands of objects, and while it runs the process launches nothing and the device
waits for it (benchmarks/RESULTS.md has such a pause in a B1 trace).
Those objects live as long as the engine, so they are moved to the collector's permanent generation
(``gc.freeze``, which costs nothing to do or undo), and collections walk only what the requests allocate:

- :func:`frozen_heap` around a generation loop in the engine's process (``LLM.generate``, the server's engine
  thread), given back after it, so an engine dropped in a cycle meanwhile is still collected later;
- :func:`freeze_for_good` in a worker process once its rank is up: the process ends with its engine.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

_frozen = False


def is_frozen() -> bool:
    """Whether this process's heap is frozen by this module."""
    return _frozen


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze every object tracked now for the duration of the block, and give them back after; nested, or
    in a process frozen for good, it leaves the heap as it is."""
    global _frozen
    if _frozen:
        yield
        return
    _frozen = True
    try:  # freezing inside: an interrupt right after it still finds the heap given back
        gc.freeze()
        yield
    finally:
        gc.unfreeze()
        _frozen = False


def freeze_for_good() -> None:
    """Freeze every object tracked now until the process ends (a worker process, once its rank is up)."""
    global _frozen
    gc.freeze()
    _frozen = True
