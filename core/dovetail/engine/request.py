"""A request inside the engine: its tokens, progress, sampling state and output text."""

from __future__ import annotations

import enum
import time
from typing import Optional

from dovetail.outputs import PositionLogprobs, RequestMetrics
from dovetail.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in the scheduler: queued, running, preempted (its KV cache given back) or finished."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class SequenceTokens:
    """Token counts of a sequence whose newest ``num_pending`` tokens were sampled on the device and are not
    yet in its lists (the engine's :class:`Request` and a worker's mirror of it share them)."""

    __slots__ = ()

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence, including sampled ones still on their way to the host."""
        return len(self.all_token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_pending

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class Request(SequenceTokens):
    """One sequence being generated (a request with ``n > 1`` becomes ``n`` of these)."""

    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                 params: SamplingParams, eos_token_ids: set[int], arrival_time: float | None = None,
                 priority: int = 0, parent_id: str | None = None, index: int = 0):
        self.request_id = request_id
        self.parent_id = parent_id or request_id
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.metrics = RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.monotonic())
        self.status = RequestStatus.WAITING
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.block_keys: list = []  # chained keys of this request's full blocks, computed lazily
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[int | str] = None
        self.output_text = ""
        self.logprobs: Optional[list[PositionLogprobs]] = [] if params.logprobs is not None else None
        self.cumulative_logprob: float = 0.0
        self.prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = (
            [None] if params.prompt_logprobs is not None else None)
        self.detokenizer = None  # set by the engine when a tokenizer exists
        self.sent_text_len = 0
        self.sent_token_len = 0
        self.max_tokens = params.max_tokens
        # Tokens sampled on the device whose values the host has not seen yet (overlapped steps).
        # ``stop_scheduling`` marks a request that will reach its length limit with them.
        self.num_pending = 0
        self.stop_scheduling = False
        # What the workers hold of this request: whether they know it, and how many of its blocks.
        self.on_workers = False
        self.num_sent_blocks = 0
        #: Its place in the scheduler's waiting queue while it waits there, else None.
        self.queue_key: Optional[tuple] = None
        #: The structured-outputs state (:class:`dovetail.engine.structured_output.GrammarState`), if constrained.
        self.grammar = None
        #: An embedding request's :class:`dovetail.pooling.PoolingParams` (a pooling model's), else None.
        self.pooling_params = None
        #: The :class:`dovetail.lora.LoRARequest` it runs with, else None (the base model).
        self.lora_request = None
        #: Speculative decoding's tokens proposed to follow its last one, computed with it in the next step.
        self.draft_token_ids: list[int] = []

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def sort_key(self) -> tuple:
        """Scheduling order: lower ``priority`` value first, then earlier arrival."""
        return (self.priority, self.metrics.arrival_time)

    def __repr__(self):
        return (f"Request({self.request_id}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
