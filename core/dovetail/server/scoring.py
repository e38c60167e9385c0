"""A sequence classifier's endpoints: ``POST /classify`` (each label's probability for each input),
``POST /score`` (a cross-encoder's relevance score of text pairs) and ``POST /rerank`` (documents ordered by
their score against a query, Jina's and Cohere's shape), with vLLM's names and fields."""

from __future__ import annotations

from fastapi import Request, Response

from dovetail.pooling import PoolingParams, pair_texts
from dovetail.server.pooled import PooledInputs
from dovetail.server.protocol import ClassificationRequest, RerankRequest, ScoreRequest
from dovetail.server.state import ServerState
from dovetail.server.streaming import respond


class _Classification(PooledInputs):
    """One ``/classify`` request."""

    id_prefix = "classify"

    def __init__(self, state: ServerState, body: ClassificationRequest):
        super().__init__(state, body.model, PoolingParams(task="classify",
                                                          truncate_prompt_tokens=body.truncate_prompt_tokens))
        self.labels = state.classifier_labels
        self.add_inputs(body.input, body.add_special_tokens)

    def response(self, finals: dict) -> dict:
        data = []
        for i, rid in enumerate(self.engine_ids):
            probs = finals[rid].outputs.probs
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append({"index": i, "label": self.labels[best] if self.labels else None, "probs": probs,
                         "num_classes": len(probs)})
        return self.listing(data)


class _Scoring(PooledInputs):
    """One ``/score`` request."""

    id_prefix = "score"

    def __init__(self, state: ServerState, body: ScoreRequest):
        super().__init__(state, body.model, PoolingParams(task="score"))
        one_first = isinstance(body.text_1, str) or len(body.text_1) == 1
        self.add_pairs(*pair_texts(body.text_1, body.text_2), ("text_1", "text_2"), one_first)

    def response(self, finals: dict) -> dict:
        return self.listing([{"index": i, "object": "score", "score": finals[rid].outputs.score}
                             for i, rid in enumerate(self.engine_ids)])


class _Rerank(PooledInputs):
    """One ``/rerank`` request."""

    id_prefix = "rerank"

    def __init__(self, state: ServerState, body: RerankRequest):
        super().__init__(state, body.model, PoolingParams(task="score"))
        self.documents, self.top_n = body.documents, body.top_n
        self.add_pairs([body.query] * len(body.documents), body.documents, ("query", "documents"), True)

    def response(self, finals: dict) -> dict:
        results = [{"index": i, "document": {"text": doc}, "relevance_score": finals[rid].outputs.score}
                   for i, (rid, doc) in enumerate(zip(self.engine_ids, self.documents))]
        results.sort(key=lambda r: -r["relevance_score"])
        return {"id": self.id, "model": self.model, "usage": {"total_tokens": self.usage()["total_tokens"]},
                "results": results[:self.top_n or None]}


async def create_classification(body: ClassificationRequest, request: Request) -> Response:
    return await respond(request, body, _Classification)


async def create_score(body: ScoreRequest, request: Request) -> Response:
    return await respond(request, body, _Scoring)


async def create_rerank(body: RerankRequest, request: Request) -> Response:
    return await respond(request, body, _Rerank)
