"""The per-step context attention layers read: this step's backend metadata.

The model runner sets it around each forward; models never pass metadata through
their own signatures, so one model class serves every attention backend.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator


@dataclass
class ForwardContext:
    """What the current forward pass's attention layers need."""

    attn_metadata: Any


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context: the model must run inside the model runner's set_forward_context")
    return _current


@contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ForwardContext(attn_metadata)
    try:
        yield _current
    finally:
        _current = previous
