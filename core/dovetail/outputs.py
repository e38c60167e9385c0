"""What generation and embedding return, with vLLM's names: RequestOutput, EmbeddingRequestOutput and their parts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class Logprob:
    """The log-probability of one token, its rank among all tokens (1 = most likely) and its text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


#: For one position: token id -> Logprob (the sampled or prompt token and the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[PositionLogprobs]] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps of a request (seconds, ``time.monotonic``)."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None


@dataclass
class RequestOutput:
    """The result (or, while streaming, the progress) of one request."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None
    num_cached_tokens: int = 0
    metrics: Optional[RequestMetrics] = None
    #: For streaming: per output index, the text and token ids added since the last output.
    deltas: list[tuple[str, list[int]]] = field(default_factory=list)


@dataclass
class EmbeddingOutput:
    """The embedding of one prompt (vLLM's name)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingRequestOutput:
    """The result of one request to a pooling model (vLLM's name): its prompt and what the model made of it."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: Any
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: Optional[RequestMetrics] = None


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    """The embedding of one prompt (vLLM's name)."""

    outputs: EmbeddingOutput


@dataclass
class ClassificationOutput:
    """A sequence classifier's probabilities for one prompt, label by label (vLLM's name)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    """The result of one ``classify`` request (vLLM's name)."""

    outputs: ClassificationOutput


@dataclass
class ScoringOutput:
    """A cross-encoder's relevance score of one query-document pair (vLLM's name)."""

    score: float


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    """The result of one ``score`` request: one pair, its tokens and its score (vLLM's name)."""

    outputs: ScoringOutput
