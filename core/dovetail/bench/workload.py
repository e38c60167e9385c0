"""Seeded request sets of the benchmarks (docs/benchmarks.md): random prompt token ids and output lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass

#: B1's request set: 256 requests, prompt and output lengths uniform in 100-1,024 (140,797 output tokens).
B1_NUM_REQUESTS = 256
B1_RANGE = (100, 1024)


@dataclass
class BenchRequest:
    """One benchmark request: its prompt's token ids and how many tokens it must generate."""

    prompt_token_ids: list[int]
    output_len: int


def random_requests(num: int, input_range: tuple[int, int], output_range: tuple[int, int], vocab_size: int,
                    seed: int = 0) -> list[BenchRequest]:
    """``num`` requests with lengths uniform in the inclusive ranges, as the peers draw them.

    The (prompt, output) length pairs come first, ``[(rng.randint(*input_range), rng.randint(*output_range))
    for _ in range(num)]`` with ``rng = random.Random(seed)``; the prompt token ids afterwards, request by
    request, from ``random.Random(seed + 1)``. With B1's arguments and seed 0 that is exactly the vLLM peer's
    request list.
    """
    rng = random.Random(seed)
    lengths = [(rng.randint(*input_range), rng.randint(*output_range)) for _ in range(num)]
    ids_rng = random.Random(seed + 1)
    return [BenchRequest([ids_rng.randrange(10, vocab_size - 10) for _ in range(prompt_len)], output_len)
            for prompt_len, output_len in lengths]


def b1_requests(vocab_size: int) -> list[BenchRequest]:
    """B1's 256 requests (docs/benchmarks.md) for a vocabulary of ``vocab_size``."""
    return random_requests(B1_NUM_REQUESTS, B1_RANGE, B1_RANGE, vocab_size, seed=0)


def greedy_inputs(requests: list[BenchRequest]) -> tuple[list[dict], list]:
    """The prompts and sampling parameters that run ``requests`` as the benchmarks do: greedy, each to its
    output length whatever tokens come (``ignore_eos``)."""
    from dovetail.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=r.output_len) for r in requests]
    return prompts, params


def warm_up(llm, prompts: list[dict], params: list, loras: list | None = None) -> None:
    """One ``generate`` on the first two prompts reversed (with the first two adapters given), so that the
    measured prompts are not already in the prefix cache."""
    llm.generate([{"prompt_token_ids": p["prompt_token_ids"][::-1]} for p in prompts[:2]], params[:2], use_tqdm=False,
                 lora_request=loras)


def parse_range(text: str) -> tuple[int, int]:
    """``"LOW:HIGH"`` (or ``"N"``) as an inclusive range of positive integers."""
    low, _, high = text.partition(":")
    low_i, high_i = int(low), int(high or low)
    if low_i < 1 or high_i < low_i:
        raise ValueError(f"expected LOW:HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return low_i, high_i
