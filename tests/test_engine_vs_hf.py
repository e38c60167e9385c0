"""Greedy tokens and logprobs of the engine (REFERENCE backend) against HF transformers."""

from __future__ import annotations

import pytest

from dovetail import LLM, SamplingParams
from tiny_models import assert_greedy_matches, hf_greedy

PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 61)), [3], list(range(100, 117)), [42] * 33]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def hf_reference(tiny_llama_hf):
    return [hf_greedy(tiny_llama_hf, p, MAX_TOKENS) for p in PROMPTS]


def _generate(llm, prompts=PROMPTS, logprobs=None):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _check(outputs, hf_reference):
    for out, (tokens, logprobs) in zip(outputs, hf_reference):
        assert_greedy_matches(out.outputs[0].token_ids, tokens, logprobs)


def test_batch_of_different_lengths_matches_hf(tiny_llama_dir, hf_reference):
    llm = LLM(str(tiny_llama_dir), attention_backend="REFERENCE")
    _check(_generate(llm), hf_reference)


def test_tiny_token_budget_chunks_prefill_and_still_matches(tiny_llama_dir, hf_reference):
    llm = LLM(str(tiny_llama_dir), attention_backend="REFERENCE", max_num_batched_tokens=7, max_num_seqs=3)
    _check(_generate(llm), hf_reference)


def test_repeated_prompt_hits_prefix_cache_without_changing_output(tiny_llama_dir, hf_reference):
    llm = LLM(str(tiny_llama_dir), attention_backend="REFERENCE", block_size=4)
    first = _generate(llm)
    second = _generate(llm)
    assert any(o.num_cached_tokens > 0 for o in second), "the repeated prompts should hit the prefix cache"
    _check(second, hf_reference)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    assert llm.reset_prefix_cache()
    third = _generate(llm)
    assert all(o.num_cached_tokens == 0 for o in third), "a reset prefix cache holds nothing"
    assert [o.outputs[0].token_ids for o in third] == [o.outputs[0].token_ids for o in first]
    engine = llm.llm_engine
    engine.add_request("running", {"prompt_token_ids": list(range(3, 40))}, SamplingParams(max_tokens=4))
    engine.step()
    assert not llm.reset_prefix_cache(), "a reset must wait until no request holds blocks"
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.reset_prefix_cache()


def test_small_kv_cache_preempts_and_recomputes_correctly(tiny_llama_dir, hf_reference):
    # Each request needs 10 blocks of 16 for its prompt and an 11th while decoding; 31 blocks admit three
    # prompts, then the decodes run out of blocks and must preempt.
    llm = LLM(str(tiny_llama_dir), attention_backend="REFERENCE", num_gpu_blocks_override=31, max_num_seqs=8,
              max_model_len=200)
    prompts = [list(range(10 + i, 160 + i)) for i in range(5)]
    from tiny_models import load_hf
    outputs = _generate(llm, prompts)
    assert llm.llm_engine.scheduler.num_preemptions > 0, "the test needs preemption to happen"
    hf = load_hf(tiny_llama_dir)
    for out, prompt in zip(outputs, prompts):
        tokens, logprobs = hf_greedy(hf, prompt, MAX_TOKENS)
        assert_greedy_matches(out.outputs[0].token_ids, tokens, logprobs)
    assert llm.llm_engine.kv_manager.pool.num_free == llm.llm_engine.num_blocks


def test_logprobs_close_to_hf(tiny_llama_dir, hf_reference):
    llm = LLM(str(tiny_llama_dir), attention_backend="REFERENCE")
    outputs = _generate(llm, logprobs=3)
    for out, (tokens, hf_lps) in zip(outputs, hf_reference):
        completion = out.outputs[0]
        assert completion.token_ids == tokens
        for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert abs(entry[token].logprob - float(hf_lps[step][token])) < 1e-4
            top = hf_lps[step].topk(3)
            for rank, (tid, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
                assert tid in entry and abs(entry[tid].logprob - lp) < 1e-4
