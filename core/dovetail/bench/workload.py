"""Seeded request sets of BENCHMARKS.md: random prompt token ids and output lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def random_requests(num: int, input_range: tuple[int, int], output_range: tuple[int, int], vocab_size: int,
                    seed: int = 0) -> list[BenchRequest]:
    """``num`` requests with lengths uniform in the inclusive ranges, drawn with ``random.Random(seed)``."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        prompt_len = rng.randint(*input_range)
        output_len = rng.randint(*output_range)
        ids = [rng.randrange(10, vocab_size - 10) for _ in range(prompt_len)]
        requests.append(BenchRequest(ids, output_len))
    return requests


def greedy_inputs(requests: list[BenchRequest]) -> tuple[list[dict], list]:
    """The prompts and sampling parameters that run ``requests`` as the benchmarks do: greedy, each to its
    output length whatever tokens come (``ignore_eos``)."""
    from dovetail.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=r.output_len) for r in requests]
    return prompts, params


def warm_up(llm, prompts: list[dict], params: list) -> None:
    """One ``generate`` on the first two prompts reversed, so that the measured prompts are not already in the
    prefix cache."""
    llm.generate([{"prompt_token_ids": p["prompt_token_ids"][::-1]} for p in prompts[:2]], params[:2], use_tqdm=False)


def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    low_i, high_i = int(low), int(high or low)
    if low_i < 1 or high_i < low_i:
        raise ValueError(f"expected LOW:HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return low_i, high_i
