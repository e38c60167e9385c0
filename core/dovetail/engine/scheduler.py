"""Continuous batching: which requests run this step, and how many tokens each.

Each step spends a token budget (``max_num_batched_tokens``) on at most
``max_num_seqs`` sequences: running decodes first, then running prefills that
were chunked, then waiting requests in priority order (chunked to fit when
``enable_chunked_prefill``), passing over those whose grammar is still
compiling and those whose LoRA adapter would be one more than ``max_loras``
among the running requests. When blocks run out, the lowest-priority running request is
preempted: its blocks are freed and it is recomputed later, keeping the tokens
it already generated.

Queues stay cheap however many sequences wait: ``waiting`` is a sorted list keyed
by (priority, arrival, order of insertion), so adding and removing a request
take O(log N); ``running`` is an insertion-ordered set (a dict), so aborting a
running request takes O(1).
"""

from __future__ import annotations

import itertools
import operator
import time
from dataclasses import dataclass, field

from sortedcontainers import SortedKeyList

from dovetail.config import EngineConfig
from dovetail.engine.kv_cache_manager import KVCacheManager
from dovetail.engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """One step's work: requests (decodes first) with the number of new tokens of each."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self):
        return bool(self.requests)


class WaitingQueue:
    """Requests waiting to be scheduled, the next one first (index 0).

    Sorted by each request's ``queue_key`` (priority, arrival, order of insertion), which the
    request keeps while it waits: adding and removing take O(log N), membership O(1).
    """

    def __init__(self):
        self._sorted = SortedKeyList(key=operator.attrgetter("queue_key"))

    def add(self, request: Request, key: tuple) -> None:
        request.queue_key = key
        self._sorted.add(request)

    def remove(self, request: Request) -> None:
        """Take ``request`` out if it waits here."""
        if request in self:
            self._sorted.remove(request)
            request.queue_key = None

    def pop(self, index: int = 0) -> Request:
        request = self._sorted.pop(index)
        request.queue_key = None
        return request

    def __contains__(self, request) -> bool:
        return getattr(request, "queue_key", None) is not None

    def __getitem__(self, index: int) -> Request:
        return self._sorted[index]

    def __iter__(self):
        return iter(self._sorted)

    def __len__(self) -> int:
        return len(self._sorted)


class Scheduler:
    """Decides each step's batch under the token budget, the sequence limit and the KV cache."""

    def __init__(self, config: EngineConfig, kv_manager: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        sched = config.scheduler
        self.max_num_seqs = sched.max_num_seqs
        self.token_budget = sched.max_num_batched_tokens
        self.chunked = sched.enable_chunked_prefill
        self.by_priority = sched.scheduling_policy == "priority"
        self.max_loras = config.lora.max_loras if config.lora.enable_lora else None
        self.waiting = WaitingQueue()
        #: Running requests in the order they were scheduled (a dict used as an ordered set).
        self.running: dict[Request, None] = {}
        self.num_preemptions = 0
        self._insertions = itertools.count()

    # -- queue management -------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self._insert_waiting(request)

    def _insert_waiting(self, request: Request) -> None:
        # Equal priority and arrival (the n samples of one request, a re-queued preempted one) keep insertion order.
        priority = request.priority if self.by_priority else 0
        self.waiting.add(request, (priority, request.metrics.arrival_time, next(self._insertions)))

    def abort(self, request: Request) -> None:
        """Remove a request wherever it is and free its blocks at once."""
        if request in self.running:
            del self.running[request]
        else:
            self.waiting.remove(request)
        self.kv.free(request)

    def finish(self, request: Request) -> None:
        """A request is done (it may have been preempted since its last token was sampled)."""
        self.abort(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step ----------------------------------------------------------------------

    def _victim(self) -> Request:
        if self.by_priority:
            return max(self.running, key=lambda r: r.sort_key())
        return next(reversed(self.running))

    def _preempt(self, victim: Request, batch: ScheduledBatch, budget: list[int]) -> None:
        del self.running[victim]
        self.kv.free(victim)
        if victim in batch.requests:
            i = batch.requests.index(victim)
            budget[0] += batch.num_new_tokens.pop(i)
            batch.requests.pop(i)
        victim.num_computed_tokens = 0
        victim.draft_token_ids = []
        victim.num_preemptions += 1
        victim.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        batch.preempted.append(victim)
        self._insert_waiting(victim)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = [self.token_budget]
        # Decodes first, then chunked prefills in progress.
        order = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens != 1)
        for request in order:
            if request not in self.running or budget[0] <= 0 or request.stop_scheduling:
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget[0])
            while not self.kv.allocate(request, num_new):
                victim = self._victim()
                self._preempt(victim, batch, budget)
                if victim is request:
                    break
            else:
                batch.requests.append(request)
                batch.num_new_tokens.append(num_new)
                budget[0] -= num_new
        self._add_drafts(batch, budget)
        if batch.preempted:
            return self._ordered(batch)
        now = time.monotonic()
        adapters = self._running_adapters() if self.max_loras else None
        index = 0
        while index < len(self.waiting) and budget[0] > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[index]
            if request.grammar is not None and not request.grammar.ready:
                index += 1  # its grammar is still compiling: the requests behind it go first
                continue
            lora = request.lora_request.lora_int_id if request.lora_request is not None else None
            if lora is not None and lora not in adapters and len(adapters) >= self.max_loras:
                index += 1  # every LoRA slot is taken by running requests' adapters
                continue
            cached = self.kv.find_cached_prefix(request)
            num_cached = len(cached) * self.kv.block_size
            num_new = request.num_tokens - num_cached
            if num_new > budget[0]:
                if not self.chunked:
                    break
                num_new = budget[0]
            request.num_computed_tokens = num_cached
            if not self.kv.allocate(request, num_new, cached):
                request.num_computed_tokens = 0
                break
            self.waiting.pop(index)
            request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            self.running[request] = None
            if lora is not None:
                adapters.add(lora)
            batch.requests.append(request)
            batch.num_new_tokens.append(num_new)
            budget[0] -= num_new
        return self._ordered(batch)

    def _add_drafts(self, batch: ScheduledBatch, budget: list[int]) -> None:
        """Speculative decoding: extend each scheduled decode by its drafts, as far as the token budget and the
        free blocks go, once every running sequence has its own token; drafts never cost a sequence its place."""
        for i, request in enumerate(batch.requests):
            drafts = request.draft_token_ids
            if not drafts:
                continue
            extra = min(len(drafts), budget[0])
            if extra and self.kv.allocate(request, batch.num_new_tokens[i] + extra):
                del drafts[extra:]
                batch.num_new_tokens[i] += extra
                budget[0] -= extra
            else:
                drafts.clear()

    def _running_adapters(self) -> set[int]:
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    @staticmethod
    def _ordered(batch: ScheduledBatch) -> ScheduledBatch:
        """Put single-token sequences first, as :class:`AttentionBatch` promises."""
        pairs = sorted(zip(batch.requests, batch.num_new_tokens), key=lambda p: p[1] != 1)
        batch.requests = [p[0] for p in pairs]
        batch.num_new_tokens = [p[1] for p in pairs]
        return batch
