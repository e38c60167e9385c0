"""What the pooling endpoints share: their inputs as engine requests, checked field by field, and usage.

A handler is built off the event loop (:func:`dovetail.server.streaming.respond`): it tokenises its inputs,
refuses a bad one with a 400 naming it (``input.2``, ``text_2``), and makes one engine request per input,
whose :class:`~dovetail.pooling.PoolingParams` say what the model is to do with it.
"""

from __future__ import annotations

import time
from typing import Optional

from dovetail.engine.async_engine import NewRequest
from dovetail.errors import RequestError
from dovetail.pooling import PoolingParams
from dovetail.server.state import ServerState


class PooledInputs:
    """One request to a pooling model: its prompts (text and token ids) and their engine requests."""

    id_prefix = "pool"

    def __init__(self, state: ServerState, model: Optional[str], params: PoolingParams):
        self.state, self.params = state, params
        self.model = state.check_model(model)
        self.id = state.new_id(self.id_prefix)
        self.created = int(time.time())
        self.prompts: list[tuple[Optional[str], list[int]]] = []

    @property
    def engine_ids(self) -> list[str]:
        return [f"{self.id}-{i}" for i in range(len(self.prompts))]

    def check_count(self, count: int, field: str) -> None:
        """400 for more inputs than the server takes in one request, before any work on them."""
        limit = self.state.settings.max_sequences_per_request
        if count > limit:
            raise RequestError(f"{field}: {count} inputs, more than this server takes in one request ({limit}, "
                               "--max-sequences-per-request)", field=field)

    def add_inputs(self, value, add_special_tokens: bool) -> None:
        """OpenAI's ``input``: a text, texts, token ids or lists of them."""
        items = [value] if isinstance(value, str) or isinstance(value[0], int) else list(value)
        self.check_count(len(items), "input")
        for i, item in enumerate(items):
            field = "input" if len(items) == 1 else f"input.{i}"
            if isinstance(item, str):
                bounded = self.params.truncate_prompt_tokens is None
                self.add(item, self.state.tokenize(item, add_special_tokens, field, bounded=bounded), field)
            else:
                self.add(None, list(item), field)

    def add_pairs(self, firsts: list[str], seconds: list[str], fields: tuple[str, str], one_first: bool) -> None:
        """Text pairs, each one prompt: the tokenizer's pair encoding (a cross-encoder's query and document).
        ``one_first``: the request gave one first text for all the second ones (its field is not indexed)."""
        self.check_count(len(seconds), fields[1])
        for i, (first, second) in enumerate(zip(firsts, seconds)):
            many = len(seconds) > 1
            names = (fields[0] if one_first or not many else f"{fields[0]}.{i}",
                     f"{fields[1]}.{i}" if many else fields[1])
            ids = self.state.prompt_tokenizer.encode_pair(first, second, names)
            self.add(f"{first}\n{second}", ids, names[1])

    def add(self, text: Optional[str], ids: list[int], field: str) -> None:
        ids = self.params.truncated(ids, self.state.max_model_len)
        if len(ids) > self.state.max_model_len:
            raise RequestError(f"{field}: the input has {len(ids)} tokens, but max_model_len is "
                               f"{self.state.max_model_len}", field=field)
        self.state.check_token_ids(ids, field)
        self.prompts.append((text, ids))

    def engine_requests(self) -> list[NewRequest]:
        return [NewRequest(rid, {"prompt_token_ids": ids, "prompt": text}, self.params)
                for rid, (text, ids) in zip(self.engine_ids, self.prompts)]

    def usage(self) -> dict:
        tokens = sum(len(ids) for _, ids in self.prompts)
        return {"prompt_tokens": tokens, "total_tokens": tokens}

    def listing(self, data: list[dict]) -> dict:
        """OpenAI's list response: one entry of ``data`` per input, in input order, and the usage."""
        return {"id": self.id, "object": "list", "created": self.created, "model": self.model, "data": data,
                "usage": self.usage()}
