"""Speculative decoding by n-gram lookup (vLLM's ``method: ngram``): proposing, then checking, draft tokens.

Before each step the engine gives every sequence that decodes a few draft tokens: those that followed the
latest earlier occurrence of its last ``n`` tokens (``prompt_lookup_max`` down to ``prompt_lookup_min``; the
first ``n`` that occurs wins). The step then computes the sequence's last token and its drafts in one pass,
and the worker samples a token at every one of those positions, each as if the drafts before it were the
sequence's own tokens (:class:`DraftPosition`): the same parameters, penalties over the tokens so far, the
same seeded noise at the same output position. Drafts are kept while they equal what was sampled; the first
sampled token that differs, or the one after the last draft, ends the step's tokens (:func:`accepted_tokens`).

Drawing the token and keeping the draft only when the two are equal is the rejection rule of speculative
sampling for a proposal that puts all its probability on one token: the draft is kept with the probability
the model gives it, and otherwise the token comes from the model's distribution without it. So outputs are
those of decoding one token at a time, and a seeded or greedy request gives the very same tokens.
"""

from __future__ import annotations

from typing import Collection

import numpy as np

from dovetail.config import SpeculativeConfig


#: Steps without a look for drafts after a look that found none.
IDLE_STEPS = 8


def latest_match(tokens: np.ndarray, length: int, n: int) -> int | None:
    """Where the latest earlier occurrence of the last ``n`` of ``tokens[:length]`` starts (None: nowhere)."""
    if length <= n:
        return None
    suffix = tokens[length - n:length]
    starts = np.flatnonzero(tokens[:length - n] == suffix[0])
    for offset in range(1, n):
        if starts.size == 0:
            break
        starts = starts[tokens[starts + offset] == suffix[offset]]
    return int(starts[-1]) if starts.size else None


def ngram_proposal(tokens: np.ndarray, length: int, count: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``count`` tokens that followed the latest earlier occurrence of the sequence's last ``n`` tokens,
    for the largest ``n`` from ``max_n`` down to ``min_n`` that occurs; [] when none does."""
    for n in range(max_n, min_n - 1, -1):
        start = latest_match(tokens, length, n)
        if start is not None:
            return tokens[start + n:min(start + n + count, length)].tolist()
    return []


def accepted_tokens(sampled: list[int], drafts: list[int]) -> list[int]:
    """The tokens a speculative row yields: ``sampled[j]`` is what was drawn after the first ``j`` drafts; each
    draft stands while it equals the token drawn in its place, and the first that differs is replaced by it
    (or, when every draft stands, the token drawn after the last one is added)."""
    tokens = []
    for draft, token in zip(drafts, sampled):
        tokens.append(token)
        if token != draft:
            return tokens
    tokens.append(sampled[len(drafts)])
    return tokens


class DraftPosition:
    """The sampler's view of a sequence ``index`` drafts into its speculative row: the tokens so far are the
    sequence's own followed by its first ``index`` drafts (what penalties, ``min_tokens`` and seeded noise
    read)."""

    __slots__ = ("state", "index")

    def __init__(self, state, index: int):
        self.state, self.index = state, index

    @property
    def params(self):
        return self.state.params

    @property
    def eos_token_ids(self):
        return self.state.eos_token_ids

    @property
    def num_output_tokens(self) -> int:
        return self.state.num_output_tokens + self.index

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.state.all_token_ids, *self.state.draft_token_ids[:self.index]]

    @property
    def output_token_ids(self) -> list[int]:
        return [*self.state.output_token_ids, *self.state.draft_token_ids[:self.index]]


def sampling_positions(state) -> list:
    """The rows a sequence samples this step: itself, then one :class:`DraftPosition` per draft."""
    return [state, *(DraftPosition(state, j) for j in range(1, len(state.draft_token_ids) + 1))]


class NgramProposer:
    """Gives the engine's decoding requests their drafts before each step; keeps each one's tokens as an array
    that grows with it, so a lookup costs no copy of the whole sequence."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.count = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.max_model_len = max_model_len
        self.disable_by_batch_size = config.disable_by_batch_size
        #: Steps to run without looking for drafts (overlapped, where the engine overlaps steps).
        self._rest = 0
        #: The largest batch whose steps with drafts replay a device graph (0: none), which needs every sequence
        #: to carry ``num_speculative_tokens`` drafts: :meth:`propose` fills short proposals up to that.
        self.graph_batch = 0
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}

    def propose(self, requests: Collection, allowed: bool = True, num_waiting: int = 0) -> None:
        """Set ``draft_token_ids`` of every request that decodes next with room for a draft: one whose tokens are
        all known (none in flight), that has a single token left to compute, no grammar, and neither its
        ``max_tokens`` nor the model's length reached by the step's last token. ``allowed`` False: no drafts this
        step (the engine's constrained rows take their bitmasks by sampled row, one row per request); nor while
        more than ``disable_by_batch_size`` sequences run (``requests``) or wait (``num_waiting``)."""
        limit = self.disable_by_batch_size
        if limit is not None and len(requests) + num_waiting > limit:
            allowed = False
        if not allowed:  # nothing to look for: the next step need not wait for this one's tokens
            for req in requests:
                req.draft_token_ids = []
            self._rest = max(self._rest, 1)
            return
        looked, found, full_room = False, False, 0
        for req in requests:
            req.draft_token_ids = []
            if (req.num_pending or req.grammar is not None or req.stop_scheduling
                    or req.num_tokens - req.num_computed_tokens != 1):
                continue
            length_room = self.max_model_len - req.num_tokens - 1
            full_room += length_room >= self.count
            room = min(self.count, req.max_tokens - req.num_output_tokens - 1, length_room)
            if room <= 0:
                continue
            tokens, length = self._tokens[req.request_id] = self._array(req)
            req.draft_token_ids = ngram_proposal(tokens, length, room, self.min_n, self.max_n)
            looked, found = True, found or bool(req.draft_token_ids)
        if found and full_room == len(requests) <= self.graph_batch:
            self._fill(requests)
        if len(self._tokens) > 2 * len(requests) + 64:  # forget the arrays of requests that have left
            live = {req.request_id for req in requests}
            self._tokens = {rid: entry for rid, entry in self._tokens.items() if rid in live}
        self._rest = 0 if found else (IDLE_STEPS if looked else max(0, self._rest - 1))

    def _fill(self, requests: Collection) -> None:
        """Give every sequence ``num_speculative_tokens`` drafts, repeating the last (of its proposal, else its
        last token) where the proposal is shorter: the step then replays a graph. Any token is a valid draft:
        one the model would not draw is simply not accepted, and tokens past ``max_tokens`` are dropped by the
        engine (the model's length still bounds them)."""
        for req in requests:
            drafts = req.draft_token_ids
            drafts += [drafts[-1] if drafts else req.all_token_ids[-1]] * (self.count - len(drafts))

    def wants_tokens(self) -> bool:
        """Whether the next step should wait for every token of the one before, to look for drafts: after a step
        that found some, and every :data:`IDLE_STEPS` steps while none are found (the steps between overlap the
        host's work with the device's, where the engine overlaps steps)."""
        return self._rest == 0

    def _array(self, req) -> tuple[np.ndarray, int]:
        known = req.all_token_ids
        tokens, length = self._tokens.get(req.request_id, (None, 0))
        if tokens is None or length > len(known) or tokens.size < len(known):
            tokens = np.empty(max(2 * len(known), 64), dtype=np.int64)
            length = 0
        tokens[length:len(known)] = known[length:]
        return tokens, len(known)
