"""Structured outputs in the engine: grammars compiled off the step loop, matchers, and each step's token bitmask.

A constrained request's grammar is parsed when it is added (a malformed one is a
:class:`RequestError` then) and compiled against the vocabulary by a thread pool,
once per distinct constraint (the compiled grammars are cached). Until its grammar
is ready the request waits in the queue while the others run. Each of its
sequences then has its own xgrammar matcher, which takes every sampled token;
before a step samples, the matchers of the constrained rows fill a token bitmask
that the sampler applies to the logits on the device. Rows without a constraint
cost nothing, and a step without constrained rows builds no bitmask.

The matchers live with the requests, on the engine's side: the bitmask is a
plain tensor that travels to the workers with the step (or, with overlapped
steps, just after it: the workers run the model while the engine applies the
step before, whose tokens the matchers need). A matcher always stands for its
sequence's output tokens (after the reasoning, when a reasoning parser is set):
should the two ever differ, the matcher is rolled back or fed the missing tokens
before its next mask.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
from typing import Callable

import torch

from dovetail.engine.grammar import parse_grammar, xgrammar_message
from dovetail.sampling_params import StructuredOutputsParams

logger = logging.getLogger("dovetail")

#: Distinct constraints whose compiled grammars are kept.
CACHE_SIZE = 256
#: From this many constrained rows on, masks are filled by xgrammar's threads.
BATCH_FILL_ROWS = 8


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's view of the vocabulary: ``vocab_size`` entries (the model's logits, which may be more or
    fewer than the tokenizer's tokens), the stop tokens, and no special token but those.

    xgrammar reads a special token such as ``<s>`` as its literal text, so a grammar could choose it
    where ``<`` may come; the detokenizer then drops it, and the text would not follow the grammar.
    """
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None)
    special = {i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special}
    special -= set(stop_token_ids)
    if not special:
        return info
    vocab = [""] * vocab_size
    for token, index in tokenizer.get_vocab().items():
        if index < vocab_size and index not in special:
            vocab[index] = token
    return xgr.TokenizerInfo.from_vocab_and_metadata(vocab, info.dump_metadata())


class GrammarState:
    """One sequence's constraint: its compiled grammar (once ready), its matcher and its reasoning state."""

    def __init__(self, future: concurrent.futures.Future, reasoning_ended: bool):
        self.future = future
        self.matcher = None
        #: Whether the reasoning is over (always, without a reasoning parser): only then does the grammar apply.
        self.reasoning_ended = reasoning_ended
        #: Index in the output of the first token the grammar governs.
        self.start = 0
        #: Output tokens the matcher has taken.
        self.num_accepted = 0
        #: The grammar has ended (it took a stop token), or a token broke it.
        self.terminated = False

    @property
    def ready(self) -> bool:
        """Whether the grammar is compiled (one that failed never is: the engine aborts its requests)."""
        return self.future.done() and self.future.exception() is None


class StructuredOutputManager:
    """Compiles grammars in the background and builds the constrained rows' bitmasks.

    ``load_tokenizer`` gives a tokenizer of its own to the compile threads (the
    engine keeps using its own meanwhile); ``reasoning`` is the engine's
    :class:`dovetail.reasoning.ReasoningParser`, or None.
    """

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int, stop_token_ids: set[int],
                 reasoning=None, enable_in_reasoning: bool = False, max_workers: int | None = None,
                 pin_memory: bool = False):
        self.load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.stop_token_set = frozenset(stop_token_ids)
        self.pin_memory = pin_memory
        self.reasoning = reasoning
        self.enable_in_reasoning = enable_in_reasoning
        workers = max_workers or max(1, min((os.cpu_count() or 2) // 2, 8))
        self.max_threads = workers
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="dovetail-grammar")
        self._cache: collections.OrderedDict[tuple, concurrent.futures.Future] = collections.OrderedDict()
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._batch_matcher = None
        #: Requests whose grammar is still compiling (request id -> request).
        self.waiting: dict[str, object] = {}
        #: Seconds to build the tokenizer's vocabulary tables, and each compile's seconds (for benchmarks).
        self.setup_seconds: float | None = None
        self.compile_seconds: list[float] = []

    # -- compiling ------------------------------------------------------------------------------

    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                t0 = time.perf_counter()
                info = tokenizer_info(self.load_tokenizer(), self.vocab_size, self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads, cache_enabled=False)
                self.setup_seconds = time.perf_counter() - t0
            return self._compiler

    def _compile(self, grammar):
        compiler = self._get_compiler()
        t0 = time.perf_counter()
        compiled = compiler.compile_grammar(grammar)
        self.compile_seconds.append(time.perf_counter() - t0)
        return compiled

    def grammar_for(self, spec: StructuredOutputsParams) -> concurrent.futures.Future:
        """The compiled grammar of ``spec`` (a future); raises :class:`RequestError` if it is malformed."""
        key = (*spec.spec(), spec.disable_any_whitespace)
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            return future
        grammar = parse_grammar(spec)
        future = self._pool.submit(self._compile, grammar)
        self._cache[key] = future
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def attach(self, request, future: concurrent.futures.Future) -> None:
        """Give ``request`` its grammar state; it waits in the queue until the grammar is compiled."""
        ended = self.reasoning is None or self.enable_in_reasoning or \
            self.reasoning.prompt_ends_reasoning(request.prompt_token_ids)
        request.grammar = GrammarState(future, ended)
        self.waiting[request.request_id] = request  # until poll() sees it compiled (or failed)

    def forget(self, request) -> None:
        self.waiting.pop(request.request_id, None)

    def poll(self) -> list[tuple[object, str]]:
        """Requests whose grammar failed to compile, with the reason; those compiled leave the waiting set."""
        failed = []
        for rid, request in list(self.waiting.items()):
            future = request.grammar.future
            if future.done():
                del self.waiting[rid]
                if future.exception() is not None:
                    failed.append((request, xgrammar_message(future.exception())))
        return failed

    def wait(self, timeout: float) -> None:
        """Block until a waiting grammar is compiled or ``timeout`` seconds pass (when nothing else can run)."""
        futures = [r.grammar.future for r in self.waiting.values()]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- matching ------------------------------------------------------------------------------

    def _matcher(self, state: GrammarState):
        if state.matcher is None:
            import xgrammar as xgr

            state.matcher = xgr.GrammarMatcher(state.future.result())
        return state.matcher

    def accept(self, pairs: list) -> list:
        """Advance the matchers of ``(request, token)`` pairs by each request's newest output ``token`` (one
        call into xgrammar for them all); return the requests whose grammar has ended, by a stop token (or
        that a token broke, which is logged)."""
        ended, matchers, tokens, accepting = [], [], [], []
        for request, token in pairs:
            state = request.grammar
            if not state.reasoning_ended:
                if token == self.reasoning.end_id:
                    state.reasoning_ended = True
                    state.start = len(request.output_token_ids)
                continue
            if state.terminated:
                ended.append(request)
                continue
            matcher = self._matcher(state)
            if not self._sync(request, state, len(request.output_token_ids) - 1):
                self._broken(request, state)
                ended.append(request)
                continue
            matchers.append(matcher)
            tokens.append(token)
            accepting.append(request)
        if matchers:
            import xgrammar as xgr

            for request, token, accepted in zip(accepting, tokens,
                                                xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)):
                state = request.grammar
                if not accepted:
                    self._broken(request, state)
                    ended.append(request)
                    continue
                state.num_accepted += 1
                if token in self.stop_token_set:  # accepted only once the grammar is complete: it terminates
                    state.terminated = True
                    ended.append(request)
        return ended

    @staticmethod
    def _broken(request, state: GrammarState) -> None:
        logger.warning("request %s: its output no longer follows its grammar; stopping it", request.request_id)
        state.terminated = True

    def _sync(self, request, state: GrammarState, upto: int) -> bool:
        """Make the matcher stand for the output tokens before index ``upto`` (a no-op while the two are in
        step); False if those tokens do not follow the grammar."""
        taken = upto - state.start
        if state.num_accepted > taken:
            state.matcher.rollback(state.num_accepted - taken)
            state.num_accepted = taken
        for token in request.output_token_ids[state.start + state.num_accepted:upto]:
            if not state.matcher.accept_token(token):
                return False
            state.num_accepted += 1
        return True

    def needs_host_tokens(self, requests: list) -> bool:
        """Whether a row's mask depends on a token still on its way from the device."""
        return any(r.grammar is not None and r.num_pending for r in requests)

    def bitmask(self, requests: list) -> tuple[torch.Tensor | None, list[int]]:
        """The next-token bitmask of the constrained rows among ``requests`` (int32 ``[rows, vocab/32]`` on the
        host) and their row numbers; ``(None, [])`` when no row is constrained."""
        rows, matchers = [], []
        for row, req in enumerate(requests):
            state = req.grammar
            if state is None or not state.reasoning_ended or state.terminated or req.is_finished:
                continue
            matcher = self._matcher(state)
            if not self._sync(req, state, len(req.output_token_ids)):
                self._broken(req, state)
                continue
            rows.append(row)
            matchers.append(matcher)
        if not rows:
            return None, []
        import xgrammar as xgr

        # Pinned on accelerators: a copy from pageable memory may wait for the work queued before it.
        mask = torch.empty(xgr.get_bitmask_shape(len(rows), self.vocab_size), dtype=xgr.bitmask_dtype,
                           pin_memory=self.pin_memory)
        if len(matchers) >= BATCH_FILL_ROWS:
            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher(self.max_threads)
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, mask)
        else:
            for i, matcher in enumerate(matchers):
                matcher.fill_next_token_bitmask(mask, i)
        return mask, rows
