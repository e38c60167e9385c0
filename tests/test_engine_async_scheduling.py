"""Overlapped (async) scheduling gives exactly the outputs of step-by-step scheduling.

The CPU runs it synchronously underneath, but every piece of the overlap runs:
tokens still on the device feed the next step, stop rules apply a step late,
length limits stop scheduling early, penalties wait for the tokens.
"""

from __future__ import annotations

import pytest

from dovetail import LLM, SamplingParams
from tiny_models import assert_greedy_matches, hf_greedy

PROMPTS = [{"prompt_token_ids": list(range(5 + i, 5 + i + n))} for i, n in enumerate((3, 40, 17, 1, 66, 9))]


@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    kwargs = dict(attention_backend="REFERENCE", max_model_len=256, block_size=8, dtype="float32",
                  num_gpu_blocks_override=400)
    return (LLM(str(tiny_llama_dir), async_scheduling=False, **kwargs),
            LLM(str(tiny_llama_dir), async_scheduling=True, **kwargs))


def _both(pair, params):
    sync, overlapped = pair
    assert overlapped.llm_engine.overlap and not sync.llm_engine.overlap
    a = sync.generate(PROMPTS, params, use_tqdm=False)
    b = overlapped.generate(PROMPTS, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
        assert [c.text for c in x.outputs] == [c.text for c in y.outputs]
        assert [c.finish_reason for c in x.outputs] == [c.finish_reason for c in y.outputs]
    for llm in pair:
        engine = llm.llm_engine
        assert engine.kv_manager.pool.num_free == engine.num_blocks and not engine.has_unfinished_requests()
    return b


def test_greedy_matches_hf(pair, tiny_llama_hf):
    out = _both(pair, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 2, 9, 16, 5, 12)])
    for o, p in zip(out, PROMPTS):
        n = len(o.outputs[0].token_ids)
        tokens, logprobs = hf_greedy(tiny_llama_hf, p["prompt_token_ids"], n)
        assert_greedy_matches(o.outputs[0].token_ids, tokens, logprobs)


def test_seeded_sampling_logprobs_and_n(pair):
    _both(pair, SamplingParams(temperature=0.9, top_p=0.9, seed=11, n=2, max_tokens=10, logprobs=2, ignore_eos=True))


def test_stop_tokens_and_eos_apply_a_step_late_without_changing_outputs(pair):
    out = _both(pair, [SamplingParams(temperature=0, max_tokens=20, logit_bias={1: 100.0}, min_tokens=3),
                       SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[55], logit_bias={55: 100.0})] * 3)
    assert out[0].outputs[0].finish_reason == "stop" and len(out[0].outputs[0].token_ids) == 4
    assert out[1].outputs[0].token_ids == [55]


def test_penalties_wait_for_every_token(pair):
    _both(pair, SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.8, presence_penalty=0.5,
                               frequency_penalty=0.3, ignore_eos=True))


def test_stop_strings_and_chunked_prefill(tiny_llama_dir):
    kwargs = dict(attention_backend="REFERENCE", max_model_len=256, max_num_batched_tokens=16, max_num_seqs=3,
                  num_gpu_blocks_override=200,
                  dtype="float32")
    pair = (LLM(str(tiny_llama_dir), async_scheduling=False, **kwargs),
            LLM(str(tiny_llama_dir), async_scheduling=True, **kwargs))
    full = pair[0].generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    _both(pair, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[full[5:8]]))


def test_preemption_under_overlap(tiny_llama_dir):
    kwargs = dict(attention_backend="REFERENCE", max_model_len=200, num_gpu_blocks_override=31, max_num_seqs=8,
                  dtype="float32")
    pair = (LLM(str(tiny_llama_dir), async_scheduling=False, **kwargs),
            LLM(str(tiny_llama_dir), async_scheduling=True, **kwargs))
    prompts = [{"prompt_token_ids": list(range(10 + i, 160 + i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    a = pair[0].generate(prompts, params, use_tqdm=False)
    b = pair[1].generate(prompts, params, use_tqdm=False)
    assert pair[1].llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_abort_while_a_step_is_in_flight(pair):
    engine = pair[1].llm_engine
    engine.add_request("keep", PROMPTS[1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.add_request("drop", PROMPTS[2], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine._in_flight is not None
    engine.abort_request("drop")
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["keep"] and len(finished[0].outputs[0].token_ids) == 6
    engine.step()  # drains the last step in flight
    assert engine.kv_manager.pool.num_free == engine.num_blocks
