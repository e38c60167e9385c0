"""Imported first by a server under test: records every text a tokenizer is called on, and holds some.

Importing it patches the tokenizers only where ``DOVETAIL_TEST_TOKENIZER_LOG`` is set (the tests
import it for :func:`calls` and :data:`HOLD`). Each call on a string appends ``start LENGTH`` and then ``end LENGTH`` to the file named by
``DOVETAIL_TEST_TOKENIZER_LOG``. A text containing :data:`HOLD` is held before tokenising until the
file named by ``DOVETAIL_TEST_TOKENIZER_RELEASE`` exists (at most two minutes): a stand-in for a
tokenisation that takes long, wherever the server runs it.
"""

from __future__ import annotations

import os
import time

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

HOLD = "HOLD"
_LOG = os.environ.get("DOVETAIL_TEST_TOKENIZER_LOG", "")
_RELEASE = os.environ.get("DOVETAIL_TEST_TOKENIZER_RELEASE", "")
_call = PreTrainedTokenizerBase.__call__


def _record(line: str) -> None:
    with open(_LOG, "a") as f:
        f.write(line + "\n")


def _spied_call(self, text=None, *args, **kwargs):
    if not isinstance(text, str):
        return _call(self, text, *args, **kwargs)
    _record(f"start {len(text)}")
    if HOLD in text:
        deadline = time.monotonic() + 120
        while not os.path.exists(_RELEASE) and time.monotonic() < deadline:
            time.sleep(0.02)
    try:
        return _call(self, text, *args, **kwargs)
    finally:
        _record(f"end {len(text)}")


if _LOG:
    PreTrainedTokenizerBase.__call__ = _spied_call


def calls(path) -> list[tuple[str, int]]:
    """The ``(event, text length)`` records of the log at ``path``."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(event, int(length)) for event, length in (line.split() for line in f if line.strip())]
