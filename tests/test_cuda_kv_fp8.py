"""TRITON's FP8 (e4m3) KV cache in the whole engine on an NVIDIA GPU (the kernels against their references run
on the GPU in tests/test_triton_kv_fp8.py): twice the blocks of a bfloat16 cache in the same memory, and greedy
decoding, CUDA graphs on and off, that follows the bfloat16 cache's."""

from __future__ import annotations

import gc

import pytest
import torch

from dovetail import LLM, SamplingParams
from tiny_models import save_model, tiny_llama_config

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 61)), [3], list(range(100, 117)), [42] * 33]
ENGINE = dict(device="cuda", dtype="bfloat16", attention_backend="TRITON", gpu_memory_utilization=0.1,
              max_num_seqs=16)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    config = tiny_llama_config(hidden_size=512, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    return save_model(tmp_path_factory.mktemp("tiny-llama-h128"), config)


TOP_LOGPROBS = 20


def _generate(llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=TOP_LOGPROBS)
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


#: The most a logprob moves when keys and values are rounded to e4m3 at unit scale (three mantissa bits, fewer
#: below 2**-6): up to 0.37 measured for this tiny model; a cache read at the wrong scale, position or block
#: moves logprobs by nats (the kernels are checked against their references in tests/test_triton_kv_fp8.py).
DRIFT = 0.5


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_fp8_kv_cache_follows_bf16(model_dir, enforce_eager):
    """Until the greedy tokens first differ, the chosen tokens' logprobs agree within :data:`DRIFT`; where they
    differ, the two tokens were within ``2 * DRIFT`` of each other under the bfloat16 cache (each may move by
    DRIFT), so the FP8 cache only breaks near ties."""
    ref_llm = LLM(str(model_dir), enforce_eager=enforce_eager, **ENGINE)
    want, ref_blocks = _generate(ref_llm), ref_llm.llm_engine.num_blocks
    del ref_llm
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(str(model_dir), kv_cache_dtype="fp8", enforce_eager=enforce_eager, **ENGINE)
    assert all(layer.kv_cache.dtype == torch.float8_e4m3fn for layer in llm.llm_engine.runner.attention_layers)
    assert llm.llm_engine.num_blocks >= 1.8 * ref_blocks  # the same bytes hold twice the tokens
    got = _generate(llm)
    agreed = 0
    for ours, ref in zip(got, want):
        for step, (token, ref_token) in enumerate(zip(ours.outputs[0].token_ids, ref.outputs[0].token_ids)):
            ref_logprobs = ref.outputs[0].logprobs[step]
            if token != ref_token:
                assert token in ref_logprobs, f"step {step}: {token} not in the bf16 top {TOP_LOGPROBS}"
                gap = ref_logprobs[ref_token].logprob - ref_logprobs[token].logprob
                assert gap <= 2 * DRIFT, f"step {step}: {token} was {gap:.3f} nats behind {ref_token}"
                break
            agreed += 1
            assert abs(ours.outputs[0].logprobs[step][token].logprob - ref_logprobs[token].logprob) < DRIFT
    assert agreed >= len(PROMPTS)  # more than nothing agrees outright
