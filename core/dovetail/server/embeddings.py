"""``POST /v1/embeddings``: one embedding per input (a text or token ids), for a pooling model.

Inputs are OpenAI's: a string, a list of strings, a list of token ids or a list of lists of them. Vectors
come back as JSON floats, or with ``encoding_format="base64"`` as the base64 of their little-endian float32
bytes (what OpenAI's client asks for by default, and decodes itself).
"""

from __future__ import annotations

import base64
import time
from typing import Optional

import numpy as np
from fastapi import Request, Response

from dovetail.engine.async_engine import NewRequest
from dovetail.errors import RequestError
from dovetail.outputs import EmbeddingRequestOutput
from dovetail.pooling import PoolingParams
from dovetail.server.protocol import EmbeddingRequest
from dovetail.server.state import ServerState
from dovetail.server.streaming import respond


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as JSON floats, or as base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


class _Embedding:
    """One embeddings request: its inputs, their engine requests and the response."""

    def __init__(self, state: ServerState, body: EmbeddingRequest):
        self.state, self.body = state, body
        self.model = state.check_model(body.model)
        self.id = state.new_id("embd")
        self.created = int(time.time())
        self.params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
        self.inputs = self._inputs()
        self.engine_ids = [f"{self.id}-{i}" for i in range(len(self.inputs))]

    def _inputs(self) -> list[tuple[Optional[str], list[int]]]:
        value = self.body.input
        items = [value] if isinstance(value, str) or isinstance(value[0], int) else list(value)
        self.state.check_sequences(1, len(items))
        inputs = []
        for i, item in enumerate(items):
            field = "input" if len(items) == 1 else f"input.{i}"
            if isinstance(item, str):
                ids = self.state.tokenize(item, self.body.add_special_tokens, field)
                inputs.append((item, ids))
            else:
                inputs.append((None, list(item)))
            ids = inputs[-1][1]
            if len(ids) > self.state.max_model_len:
                raise RequestError(f"{field}: the input has {len(ids)} tokens, but max_model_len is "
                                   f"{self.state.max_model_len}", field=field)
            self.state.check_token_ids(ids, field)
        return inputs

    def engine_requests(self) -> list[NewRequest]:
        return [NewRequest(rid, {"prompt_token_ids": ids, "prompt": text}, self.params)
                for rid, (text, ids) in zip(self.engine_ids, self.inputs)]

    def response(self, finals: dict[str, EmbeddingRequestOutput]) -> dict:
        data = [{"object": "embedding", "index": i,
                 "embedding": encode_vector(finals[rid].outputs.embedding, self.body.encoding_format)}
                for i, rid in enumerate(self.engine_ids)]
        prompt_tokens = sum(len(ids) for _, ids in self.inputs)
        return {"id": self.id, "object": "list", "created": self.created, "model": self.model, "data": data,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
    return await respond(request, body, _Embedding)
