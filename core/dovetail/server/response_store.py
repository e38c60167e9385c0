"""Stored responses of ``/v1/responses``: retrieved by id, deleted, and continued by ``previous_response_id``.

The store is in the server's memory and off unless ``DOVETAIL_ENABLE_RESPONSES_API_STORE`` is true (vLLM's
``VLLM_ENABLE_RESPONSES_API_STORE``): every stored response keeps its whole conversation. It holds at most
``DOVETAIL_RESPONSES_API_STORE_MAX`` responses (default 10,000), forgetting the oldest first.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping, Optional

STORE_ENV = "DOVETAIL_ENABLE_RESPONSES_API_STORE"
STORE_MAX_ENV = "DOVETAIL_RESPONSES_API_STORE_MAX"
DEFAULT_CAPACITY = 10_000


@dataclass(frozen=True)
class StoredResponse:
    """A finished response and the chat messages that continue it (its input, then its output)."""

    response: dict
    messages: list[dict]


class ResponseStore:
    """Finished responses by id, the oldest forgotten beyond ``capacity``; safe to use from several threads."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"{STORE_MAX_ENV}: must be at least 1 (got {capacity})")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> Optional["ResponseStore"]:
        """The store the environment asks for, or None when storing is off."""
        if environ.get(STORE_ENV, "").strip().lower() not in ("1", "true", "yes"):
            return None
        raw = environ.get(STORE_MAX_ENV, "").strip()
        try:
            capacity = int(raw) if raw else DEFAULT_CAPACITY
        except ValueError:
            raise ValueError(f"{STORE_MAX_ENV}: must be an integer (got {raw!r})") from None
        return cls(capacity)

    def put(self, stored: StoredResponse) -> None:
        with self._lock:
            self._items[stored.response["id"]] = stored
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> Optional[StoredResponse]:
        with self._lock:
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)
