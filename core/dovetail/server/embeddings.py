"""``POST /v1/embeddings``: one embedding per input (a text or token ids), for an embedding model.

Inputs are OpenAI's: a string, a list of strings, a list of token ids or a list of lists of them. Vectors
come back as JSON floats, or with ``encoding_format="base64"`` as the base64 of their little-endian float32
bytes (what OpenAI's client asks for by default, and decodes itself).
"""

from __future__ import annotations

import base64

import numpy as np
from fastapi import Request, Response

from dovetail.outputs import EmbeddingRequestOutput
from dovetail.pooling import PoolingParams
from dovetail.server.pooled import PooledInputs
from dovetail.server.protocol import EmbeddingRequest
from dovetail.server.state import ServerState
from dovetail.server.streaming import respond


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as JSON floats, or as base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


class _Embedding(PooledInputs):
    """One embeddings request."""

    id_prefix = "embd"

    def __init__(self, state: ServerState, body: EmbeddingRequest):
        super().__init__(state, body.model, PoolingParams(
            dimensions=body.dimensions, normalize=body.normalize, task="embed",
            truncate_prompt_tokens=body.truncate_prompt_tokens))
        self.encoding_format = body.encoding_format
        self.add_inputs(body.input, body.add_special_tokens)

    def response(self, finals: dict[str, EmbeddingRequestOutput]) -> dict:
        return self.listing([{"object": "embedding", "index": i,
                              "embedding": encode_vector(finals[rid].outputs.embedding, self.encoding_format)}
                             for i, rid in enumerate(self.engine_ids)])


async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
    return await respond(request, body, _Embedding)
