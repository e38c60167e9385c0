"""The sampler's device-side parts: counter-based seeded noise, and one host synchronisation per call (GPU)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from dovetail.engine.request import Request
from dovetail.engine.sampler import sample, seeded_exponential
from dovetail.sampling_params import SamplingParams


def test_seeded_noise_depends_only_on_seed_step_and_token():
    seeds = torch.tensor([7, -3, 7, 2**62], dtype=torch.long)
    steps = torch.tensor([0, 5, 1, 0], dtype=torch.long)
    noise = seeded_exponential(seeds, steps, 1000)
    alone = seeded_exponential(seeds[2:3], steps[2:3], 1000)
    assert torch.equal(noise[2], alone[0]), "a row's noise must not depend on the other rows"
    assert not torch.equal(noise[0], noise[2]), "another step must draw other noise"
    assert torch.equal(seeded_exponential(seeds[:1], steps[:1], 500)[0], noise[0, :500]), \
        "the noise of token t must not depend on the vocabulary size"


def test_seeded_noise_is_exponential():
    noise = seeded_exponential(torch.arange(64, dtype=torch.long) * 7919, torch.zeros(64, dtype=torch.long), 4096)
    assert noise.min() > 0 and torch.isfinite(noise).all()
    assert abs(noise.mean().item() - 1.0) < 0.01  # 262144 draws: the standard error is 0.002
    assert abs((noise < math.log(2)).float().mean().item() - 0.5) < 0.005  # the median of Exp(1) is ln 2


def _requests(params_list):
    return [Request(str(i), None, [1, 2, 3], p, {0}) for i, p in enumerate(params_list)]


@pytest.mark.gpu
def test_sample_synchronises_with_the_host_once():
    torch.manual_seed(0)
    logits = torch.randn(6, 151936, device="cuda")
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9, top_k=50),
              SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.7, min_p=0.05, seed=11),
              SamplingParams(temperature=1.0, logprobs=5), SamplingParams(temperature=0, repetition_penalty=1.2,
                                                                          presence_penalty=0.5, logit_bias={7: 3.0})]
    requests = _requests(params)
    sample(logits, requests)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = sample(logits, requests)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    assert result.token_ids[0] == int(logits[0].argmax())
    assert result.logprobs[4] is not None and len(result.logprobs[4][2]) == 5


@pytest.mark.gpu
def test_seeded_rows_do_not_depend_on_the_batch_on_the_gpu():
    torch.manual_seed(0)
    logits = torch.randn(4, 32000, device="cuda")
    seeded = SamplingParams(temperature=1.0, seed=1234)
    batch = sample(logits, _requests([SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=0.5),
                                      SamplingParams(temperature=0)]))
    alone = sample(logits[1:2], _requests([seeded]))
    assert batch.token_ids[1] == alone.token_ids[0]
