"""Turns logits into tokens for a batch of requests, each with its own SamplingParams.

Order of operations (vLLM's): logprobs are taken from the raw logits; then
logit bias, ``min_tokens`` (EOS and stop tokens banned), repetition, presence
and frequency penalties; greedy rows take the argmax; random rows divide by the
temperature, apply top-k, top-p and min-p, and draw with an exponential race
(``argmax(p / q)``, ``q ~ Exp(1)``) whose noise comes from the request's own
generator when it has a seed, so its tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dovetail.engine.request import Request


@dataclass
class SampleResult:
    """The sampled tokens and, for requests that asked, their logprobs."""

    token_ids: list[int]
    # Per row: (sampled logprob, sampled rank, [(token, logprob), ...] top-k) or None.
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]


def _penalties(logits: torch.Tensor, requests: list[Request], vocab: int) -> None:
    for row, req in enumerate(requests):
        p = req.params
        output_ids = req.output_token_ids
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            seen[torch.tensor(req.all_token_ids, device=logits.device, dtype=torch.long)] = True
            seen = seen[: logits.shape[1]]
            values = logits[row]
            penalised = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
            logits[row] = torch.where(seen, penalised, values)
        if (p.presence_penalty or p.frequency_penalty) and output_ids:
            counts = torch.bincount(torch.tensor(output_ids, device=logits.device), minlength=vocab)
            counts = counts[: logits.shape[1]].to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _bias_and_bans(logits: torch.Tensor, requests: list[Request]) -> None:
    vocab = logits.shape[1]
    for row, req in enumerate(requests):
        p = req.params
        if p.logit_bias:
            for token, bias in p.logit_bias.items():
                if token < vocab:
                    logits[row, token] += bias
        if len(req.output_token_ids) < p.min_tokens:
            banned = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                banned |= req.eos_token_ids
            for token in banned:
                if token < vocab:
                    logits[row, token] = float("-inf")


def _filter(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Mask tokens outside top-k, top-p and min-p (per-row values; 0 / 1 / 0 disable them)."""
    vocab, dev = logits.shape[1], logits.device
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        top_k_t = torch.tensor([k if k > 0 else vocab for k in top_k], device=dev).clamp(max=vocab)
        top_p_t = torch.tensor(top_p, device=dev)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        keep = torch.ones_like(sorted_logits, dtype=torch.bool)
        keep &= torch.arange(vocab, device=dev).unsqueeze(0) < top_k_t.unsqueeze(1)
        probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        keep &= before < top_p_t.unsqueeze(1)
        keep[:, 0] = True
        mask = torch.zeros_like(keep).scatter_(1, order, keep)
        logits = logits.masked_fill(~mask, float("-inf"))
    if any(m > 0 for m in min_p):
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, device=dev).unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _top_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, requests: list[Request]):
    results: list = [None] * len(requests)
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not rows:
        return results
    index = torch.tensor(rows, device=logprobs.device)
    lp = logprobs.index_select(0, index)
    chosen = sampled.index_select(0, index)
    chosen_lp = lp.gather(1, chosen.unsqueeze(1)).squeeze(1)
    ranks = (lp > chosen_lp.unsqueeze(1)).sum(dim=1) + 1
    k_max = max(requests[i].params.logprobs for i in rows)
    top_vals, top_ids = (lp.topk(k_max, dim=-1) if k_max else (lp[:, :0], lp[:, :0].long()))
    chosen_lp, ranks = chosen_lp.tolist(), ranks.tolist()
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for j, row in enumerate(rows):
        k = requests[row].params.logprobs
        results[row] = (chosen_lp[j], ranks[j], list(zip(top_ids[j][:k], top_vals[j][:k])))
    return results


def sample(logits: torch.Tensor, requests: list[Request], vocab_size: int | None = None) -> SampleResult:
    """Sample one token per row of ``logits`` (``[rows, vocab]``), row ``i`` for ``requests[i]``."""
    logits = logits.float()
    if vocab_size is not None and logits.shape[1] > vocab_size:
        logits = logits[:, :vocab_size]
    want_logprobs = any(r.params.logprobs is not None for r in requests)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    if any(r.params.logit_bias or len(r.output_token_ids) < r.params.min_tokens for r in requests):
        logits = logits.clone()
        _bias_and_bans(logits, requests)
    if any(r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty
           for r in requests):
        logits = logits.clone()
        _penalties(logits, requests, logits.shape[1])

    sampled = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        sub = logits.index_select(0, index)
        dev = sub.device
        temps = torch.tensor([requests[i].params.temperature for i in random_rows], device=dev)
        sub = sub / temps.unsqueeze(1)
        sub = _filter(
            sub,
            [max(requests[i].params.top_k, 0) for i in random_rows],
            [requests[i].params.top_p for i in random_rows],
            [requests[i].params.min_p for i in random_rows],
        )
        probs = sub.softmax(dim=-1)
        noise = torch.empty_like(probs)
        unseeded = []
        for j, i in enumerate(random_rows):
            gen = requests[i].generator
            if gen is None:
                unseeded.append(j)
            else:
                noise[j] = torch.empty(probs.shape[1]).exponential_(generator=gen).to(dev)
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=dev).exponential_()
        sampled[index] = (probs / noise).argmax(dim=-1)

    logprob_info = _top_logprobs(raw_logprobs, sampled, requests) if want_logprobs else [None] * len(requests)
    return SampleResult(token_ids=sampled.tolist(), logprobs=logprob_info)
