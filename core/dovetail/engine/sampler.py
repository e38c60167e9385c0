"""Turns logits into tokens for a batch of requests, each with its own SamplingParams.

Order of operations (vLLM's): logprobs are taken from the raw logits; then
logit bias, ``min_tokens`` (EOS and stop tokens banned), repetition, presence
and frequency penalties; greedy rows take the argmax; random rows divide by the
temperature, apply top-k, top-p and min-p, and draw with an exponential race
(``argmax(p / q)``, ``q ~ Exp(1)``).

A request with a seed draws its noise from a counter-based generator keyed by
``(seed, output position, token)``, so its tokens depend neither on the rest of
the batch nor on the device's random state, and a recomputed (preempted) step
draws the same noise. Everything runs on the logits' device; per-request values
travel in one non-blocking copy, and the only synchronisation is the single
transfer of the results to the host at the end of :func:`sample`.

The rows are a worker's request mirrors (:class:`~dovetail.engine.request_state.RequestState`),
or anything with their fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dovetail.device_copy import values_to_device
from dovetail.engine.sharded_logits import ShardedLogits

if TYPE_CHECKING:
    from dovetail.engine.request_state import RequestState


@dataclass
class SampleResult:
    """The sampled tokens and, for requests that asked, their logprobs."""

    token_ids: list[int]
    # Per row: (sampled logprob, sampled rank, [(token, logprob), ...] top-k) or None.
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]


# -- counter-based noise for seeded requests -------------------------------------------------

_GAMMA = 0x9E3779B97F4A7C15 - 2**64  # SplitMix64's constants, as signed 64-bit integers
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def seeded_exponential(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise ``[rows, vocab]`` float32: SplitMix64 of ``seed`` at counter ``step * vocab + token``.

    ``seeds`` and ``steps`` are int64 ``[rows]`` on the target device.
    """
    tokens = torch.arange(vocab, device=seeds.device, dtype=torch.long)
    counter = steps.unsqueeze(1) * vocab + tokens + 1
    z = seeds.unsqueeze(1) + counter * _GAMMA
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    uniform = (_shr(z, 40).float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -torch.log(uniform)


def _signed64(seed: int) -> int:
    seed %= 2**64
    return seed - 2**64 if seed >= 2**63 else seed


# -- logit processing -------------------------------------------------------------------------


def _bias_and_bans(logits: torch.Tensor, requests: list[RequestState]) -> None:
    vocab = logits.shape[1]
    rows, tokens, values, ban_rows, ban_tokens = [], [], [], [], []
    for row, req in enumerate(requests):
        p = req.params
        for token, bias in (p.logit_bias or {}).items():
            if token < vocab:
                rows.append(row)
                tokens.append(token)
                values.append(float(bias))
        if req.num_output_tokens < p.min_tokens:
            banned = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                banned |= req.eos_token_ids
            banned = [t for t in banned if t < vocab]
            ban_rows += [row] * len(banned)
            ban_tokens += banned
    dev = logits.device
    if rows:
        index = (values_to_device(rows, torch.long, dev), values_to_device(tokens, torch.long, dev))
        logits.index_put_(index, values_to_device(values, logits.dtype, dev), accumulate=True)
    if ban_rows:
        index = (values_to_device(ban_rows, torch.long, dev), values_to_device(ban_tokens, torch.long, dev))
        logits.index_put_(index, torch.full((1,), float("-inf"), dtype=logits.dtype, device=dev))


def _penalties(logits: torch.Tensor, requests: list[RequestState]) -> None:
    """Repetition (over prompt and output), presence and frequency (over the output) penalties."""
    rows_n, vocab, dev = logits.shape[0], logits.shape[1], logits.device
    rep_rows, rep_tokens, out_rows, out_tokens = [], [], [], []
    repetition, presence, frequency = [], [], []
    for row, req in enumerate(requests):
        p = req.params
        repetition.append(p.repetition_penalty)
        presence.append(p.presence_penalty)
        frequency.append(p.frequency_penalty)
        if p.repetition_penalty != 1.0:
            seen = [t for t in req.all_token_ids if t < vocab]
            rep_rows += [row] * len(seen)
            rep_tokens += seen
        if p.presence_penalty or p.frequency_penalty:
            output = [t for t in req.output_token_ids if t < vocab]
            out_rows += [row] * len(output)
            out_tokens += output
    if rep_rows:
        seen = torch.zeros(rows_n, vocab, dtype=torch.bool, device=dev)
        seen.index_put_((values_to_device(rep_rows, torch.long, dev), values_to_device(rep_tokens, torch.long, dev)),
                        torch.ones(1, dtype=torch.bool, device=dev))
        penalty = values_to_device(repetition, logits.dtype, dev).unsqueeze(1)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, penalised, logits))
    if out_rows:
        counts = torch.zeros(rows_n, vocab, dtype=logits.dtype, device=dev)
        counts.index_put_((values_to_device(out_rows, torch.long, dev), values_to_device(out_tokens, torch.long, dev)),
                          torch.ones(1, dtype=logits.dtype, device=dev), accumulate=True)
        logits -= (values_to_device(frequency, logits.dtype, dev).unsqueeze(1) * counts
                   + values_to_device(presence, logits.dtype, dev).unsqueeze(1) * (counts > 0).to(logits.dtype))


def _filter(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Mask tokens outside top-k, top-p and min-p (per-row values; 0 / 1 / 0 disable them)."""
    vocab, dev = logits.shape[1], logits.device
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        top_k_t = values_to_device([min(k, vocab) if k > 0 else vocab for k in top_k], torch.long, dev)
        top_p_t = values_to_device(top_p, torch.float32, dev)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        keep = torch.arange(vocab, device=dev).unsqueeze(0) < top_k_t.unsqueeze(1)
        probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        keep &= before < top_p_t.unsqueeze(1)
        keep[:, 0] = True
        mask = torch.zeros_like(keep).scatter_(1, order, keep)
        logits = logits.masked_fill(~mask, float("-inf"))
    if any(m > 0 for m in min_p):
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * values_to_device(min_p, torch.float32, dev).unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _sample_random(logits: torch.Tensor, sampled: torch.Tensor, requests: list[RequestState]) -> None:
    """Draw the non-greedy rows of ``sampled`` in place."""
    random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if not random_rows:
        return
    dev = logits.device
    params = [requests[i].params for i in random_rows]
    index = values_to_device(random_rows, torch.long, dev)
    temperature = values_to_device([p.temperature for p in params], torch.float32, dev)
    sub = logits.index_select(0, index) / temperature.unsqueeze(1)
    sub = _filter(sub, [max(p.top_k, 0) for p in params], [p.top_p for p in params], [p.min_p for p in params])
    probs = sub.softmax(dim=-1)
    seeded = [j for j, p in enumerate(params) if p.seed is not None]
    if len(seeded) == len(params):
        noise = torch.empty(0)
    else:
        noise = torch.empty_like(probs).exponential_()
    if seeded:
        seeds = values_to_device([_signed64(params[j].seed) for j in seeded], torch.long, dev)
        steps = values_to_device([requests[random_rows[j]].num_output_tokens for j in seeded], torch.long, dev)
        seeded_noise = seeded_exponential(seeds, steps, probs.shape[1])
        if len(seeded) == len(params):
            noise = seeded_noise
        else:
            noise.index_copy_(0, values_to_device(seeded, torch.long, dev), seeded_noise)
    sampled.index_copy_(0, index, (probs / noise).argmax(dim=-1))


def _top_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, rows: list[int], k_max: int):
    """Device tensors for the rows that asked: the sampled logprob, its rank, and the top ``k_max``."""
    index = values_to_device(rows, torch.long, logprobs.device)
    lp = logprobs.index_select(0, index)
    chosen_lp = lp.gather(1, sampled.index_select(0, index).unsqueeze(1)).squeeze(1)
    ranks = (lp > chosen_lp.unsqueeze(1)).sum(dim=1) + 1
    top_vals, top_ids = lp.topk(k_max, dim=-1) if k_max else (lp[:, :0], lp[:, :0].long())
    return chosen_lp, ranks, top_vals, top_ids


def _plain_greedy(p, req: RequestState) -> bool:
    """Greedy with nothing that changes the logits or asks for logprobs: the argmax of the raw logits."""
    return (p.greedy and p.logprobs is None and not p.logit_bias and req.num_output_tokens >= p.min_tokens
            and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty)


@dataclass
class PendingSample:
    """Tokens sampled on the device, on their way to the host.

    ``tokens`` (int64 ``[rows]``, on the device) can feed the next step before the
    host has seen them; :meth:`result` waits for the transfer started by
    :meth:`start_transfer` (or copies now) and decodes it.
    """

    tokens: torch.Tensor
    packed: torch.Tensor
    decode: "callable"
    _copy: object = None

    def start_transfer(self, platform) -> None:
        self._copy = platform.copy_to_host_async(self.packed)

    def result(self) -> SampleResult:
        host = self._copy.wait() if self._copy is not None else self.packed
        return self.decode(host.tolist())


def launch_sample(logits: torch.Tensor | ShardedLogits, requests: list[RequestState], vocab_size: int | None = None,
                  argmax=None) -> PendingSample:
    """Queue the sampling of one token per row of ``logits`` (``[rows, vocab]``, or a rank's vocabulary shard
    of them); nothing waits for the device.

    ``argmax`` (the platform's ``FusedOps.argmax``; None: torch's) picks the tokens of a step whose rows are
    all plain greedy."""
    n = len(requests)
    if all(_plain_greedy(r.params, r) for r in requests):
        if isinstance(logits, ShardedLogits):
            sampled = logits.greedy_tokens()
        else:
            top = logits[:, :vocab_size] if vocab_size is not None else logits
            sampled = argmax(top) if argmax is not None else top.argmax(dim=-1)
        return PendingSample(sampled, sampled, lambda host: SampleResult(host, [None] * n))
    if isinstance(logits, ShardedLogits):
        logits = logits.gather()
    logits = logits.float()
    if vocab_size is not None and logits.shape[1] > vocab_size:
        logits = logits[:, :vocab_size]
    logprob_rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if logprob_rows else None
    if any(r.params.logit_bias or r.num_output_tokens < r.params.min_tokens for r in requests):
        logits = logits.clone()
        _bias_and_bans(logits, requests)
    if any(r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty
           for r in requests):
        logits = logits.clone()
        _penalties(logits, requests)
    sampled = logits.argmax(dim=-1)
    _sample_random(logits, sampled, requests)
    if not logprob_rows:
        return PendingSample(sampled, sampled, lambda host: SampleResult(host, [None] * n))

    # One transfer for everything: int64 token ids and float32 logprobs fit float64 exactly.
    k_max = max(requests[i].params.logprobs for i in logprob_rows)
    chosen_lp, ranks, top_vals, top_ids = _top_logprobs(raw_logprobs, sampled, logprob_rows, k_max)
    packed = torch.cat([sampled.double(), chosen_lp.double(), ranks.double(), top_vals.double().flatten(),
                        top_ids.double().flatten()])
    top_k = [requests[row].params.logprobs for row in logprob_rows]

    def decode(values: list) -> SampleResult:
        m = len(logprob_rows)
        token_ids = [int(t) for t in values[:n]]
        chosen, rank_list = values[n:n + m], values[n + m:n + 2 * m]
        vals, ids = values[n + 2 * m:n + 2 * m + m * k_max], values[n + 2 * m + m * k_max:]
        results: list = [None] * n
        for j, row in enumerate(logprob_rows):
            top = [(int(ids[j * k_max + t]), vals[j * k_max + t]) for t in range(top_k[j])]
            results[row] = (chosen[j], int(rank_list[j]), top)
        return SampleResult(token_ids=token_ids, logprobs=results)

    return PendingSample(sampled, packed, decode)


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[tuple[float, int, list]]:
    """Per row of ``logits``: the logprob of ``targets[row]``, its rank, and the top ``k`` ``(token, logprob)``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(targets, device=logprobs.device).unsqueeze(1)).squeeze(1)
    ranks = ((logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1).tolist()
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    chosen, top_vals, top_ids = chosen.tolist(), top_vals.tolist(), top_ids.tolist()
    return [(chosen[i], ranks[i], list(zip(top_ids[i], top_vals[i]))) for i in range(len(targets))]


def sample(logits: torch.Tensor, requests: list[RequestState], vocab_size: int | None = None) -> SampleResult:
    """Sample one token per row of ``logits`` and wait for the result (one transfer to the host)."""
    return launch_sample(logits, requests, vocab_size).result()
