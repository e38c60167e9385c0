"""The engine's side of a pooling model: which requests it takes, and what each finished one returns.

The workers pool; the engine turns each pooled state into the request's answer: an embedding (truncated
to its ``dimensions``, normalised), or a sequence classifier's probabilities or score.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dovetail import pooling
from dovetail.engine.request import Request
from dovetail.errors import RequestError
from dovetail.outputs import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,
                              EmbeddingRequestOutput, PoolingRequestOutput, ScoringOutput, ScoringRequestOutput)
from dovetail.pooling import PoolingParams
from dovetail.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("dovetail")

#: What the scheduler and the workers see of a pooling request: one row at the end of its prompt.
POOLING_ROW = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)


class PoolingModel:
    """A pooling model's settings (resolved :class:`dovetail.pooling.PoolerConfig`), its task and, for a
    sequence classifier, its head."""

    def __init__(self, model_path: str | Path, hf_config, pooler_config: dict):
        self.hf_config = hf_config
        self.pooling_type: str = pooler_config["pooling_type"]
        self.normalize: bool = pooler_config["normalize"]
        #: ``embed``, or ``classify`` for a sequence classifier (whose head also scores pairs).
        self.task = pooling.model_task(getattr(hf_config, "architectures", None) or [])
        self.classifier = (pooling.ClassifierHead.load(model_path, hf_config) if self.task == "classify"
                           else None)

    def describe(self) -> str:
        if self.classifier is not None:
            return f"a sequence classifier of {self.classifier.num_labels} label(s), {self.pooling_type} pooling"
        return f"embeddings, {self.pooling_type} pooling, {'normalised' if self.normalize else 'not normalised'}"

    def check(self, params: PoolingParams) -> None:
        """Refuse a task this model cannot do, or dimensions it cannot give, naming the field."""
        task = params.task or self.task
        if (task == "embed") != (self.task == "embed"):
            kind = "an embedding model" if self.task == "embed" else "a sequence classifier"
            can = "embed" if self.task == "embed" else "classify and score"
            raise RequestError(f"task: this model is {kind}: it can {can}, not {task}", field="task")
        if task == "score" and self.classifier.num_labels != 1:
            raise RequestError(f"task: scoring needs a classifier of one label (a cross-encoder); this one has "
                               f"{self.classifier.num_labels}", field="task")
        if task != "embed" and params.dimensions is not None:
            raise RequestError("dimensions: only embeddings have dimensions", field="dimensions")
        pooling.check_dimensions(params, self.hf_config, int(self.hf_config.hidden_size))

    def output(self, req: Request, pooled: torch.Tensor) -> PoolingRequestOutput:
        """What a finished pooling request returns, by its task."""
        params = req.pooling_params
        task = params.task or self.task
        if task == "embed":
            cls, result = EmbeddingRequestOutput, EmbeddingOutput(
                pooling.finish_embedding(pooled, params, self.normalize))
        else:
            probs = self.classifier.probabilities(pooled)
            cls, result = ((ClassificationRequestOutput, ClassificationOutput(probs)) if task == "classify"
                           else (ScoringRequestOutput, ScoringOutput(probs[0])))
        return cls(req.request_id, req.prompt, req.prompt_token_ids, result, True, req.num_cached_tokens,
                   req.metrics)
