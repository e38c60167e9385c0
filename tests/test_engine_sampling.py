"""SamplingParams behaviour through the engine: seeds, penalties, stops, n, logprobs, validation."""

from __future__ import annotations

import pytest
import torch

from dovetail import LLM, SamplingParams
from dovetail.errors import RequestError
from tiny_models import load_hf

PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}
OTHER = [{"prompt_token_ids": list(range(30, 30 + n))} for n in (3, 17, 40)]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), attention_backend="REFERENCE", max_model_len=256)


def _one(llm, params, prompt=PROMPT):
    return llm.generate([prompt], params, use_tqdm=False)[0]


def test_seeded_sampling_is_independent_of_the_batch(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    alone = _one(llm, params).outputs[0].token_ids
    noisy = SamplingParams(temperature=1.3, max_tokens=25, ignore_eos=True)
    mixed = llm.generate([OTHER[0], PROMPT, OTHER[1], OTHER[2]],
                         [noisy, params, SamplingParams(temperature=0.7, seed=9, max_tokens=5), noisy],
                         use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    different_seed = _one(llm, SamplingParams(temperature=1.0, seed=4321, max_tokens=20, ignore_eos=True))
    assert different_seed.outputs[0].token_ids != alone


def test_top_k_one_is_greedy(llm):
    greedy = _one(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)).outputs[0].token_ids
    top1 = _one(llm, SamplingParams(temperature=5.0, top_k=1, max_tokens=12, ignore_eos=True)).outputs[0].token_ids
    assert top1 == greedy


def test_logit_bias_forces_a_token(llm):
    out = _one(llm, SamplingParams(temperature=0, max_tokens=5, logit_bias={77: 100.0}, ignore_eos=True))
    assert out.outputs[0].token_ids == [77] * 5


def test_min_tokens_holds_back_eos_then_eos_stops(llm):
    eos = 1
    out = _one(llm, SamplingParams(temperature=0, max_tokens=20, min_tokens=4, logit_bias={eos: 100.0}))
    completion = out.outputs[0]
    assert completion.token_ids[:4] != [eos] * 4 and eos not in completion.token_ids[:4]
    assert completion.token_ids[4] == eos and completion.finish_reason == "stop"
    assert len(completion.token_ids) == 5


def test_stop_token_ids(llm):
    out = _one(llm, SamplingParams(temperature=0, max_tokens=20, logit_bias={55: 100.0}, stop_token_ids=[55]))
    completion = out.outputs[0]
    assert completion.token_ids == [55] and completion.finish_reason == "stop" and completion.stop_reason == 55


def test_stop_string_is_cut_from_the_text(llm):
    full = _one(llm, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)).outputs[0].text
    stop = full[6:9]
    assert len(stop) == 3 and stop.strip(), f"need a visible stop string, got {full!r}"
    out = _one(llm, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])).outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]
    kept = _one(llm, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=stop,
                                    include_stop_str_in_output=True)).outputs[0]
    assert kept.text == full[: full.index(stop) + len(stop)]


def test_max_tokens_finishes_with_length(llm):
    out = _one(llm, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)).outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_n_samples_are_distinct_and_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    first = _one(llm, params)
    second = _one(llm, params)
    tokens = [c.token_ids for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len({tuple(t) for t in tokens}) == 3
    assert tokens == [c.token_ids for c in second.outputs]


def test_penalties_change_the_greedy_continuation(llm):
    base = _one(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)).outputs[0].token_ids
    assert len(set(base)) < len(base), "the tiny model repeats itself, which the penalties should change"
    for field in ("presence_penalty", "frequency_penalty"):
        penalised = _one(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **{field: 2.0}))
        assert penalised.outputs[0].token_ids != base, field
    rep = _one(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=2.0))
    assert rep.outputs[0].token_ids != base


def test_sampler_penalty_arithmetic_matches_vllm_definitions():
    from dovetail.engine.request import Request
    from dovetail.engine.sampler import _penalties

    req = Request("r", None, [3, 4], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25,
                                                    repetition_penalty=2.0), set())
    for t in (4, 5, 5):
        req.append_token(t)
    logits = torch.tensor([[1.0, 1.0, 1.0, 2.0, -2.0, 4.0, 1.0]])
    _penalties(logits, [req])
    # token 3: prompt only -> repetition: 2.0 / 2 = 1.0
    # token 4: prompt and output once -> repetition: -2 * 2 = -4, then -0.25 - 0.5
    # token 5: output twice -> 4 / 2 = 2, then -0.5 - 0.5
    assert logits.tolist()[0] == pytest.approx([1.0, 1.0, 1.0, 1.0, -4.75, 1.0, 1.0])


def test_top_p_and_min_p_filter_the_tail():
    from dovetail.engine.sampler import _filter

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = _filter(logits.clone(), [0], [0.7], [0.0])
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]
    kept = _filter(logits.clone(), [0], [1.0], [0.25])
    assert torch.isfinite(kept).tolist() == [[True, True, True, False]]
    kept = _filter(logits.clone(), [3], [1.0], [0.0])
    assert torch.isfinite(kept).tolist() == [[True, True, True, False]]


def test_prompt_logprobs_match_hf(llm, tiny_llama_dir):
    prompt = list(range(40, 60))
    out = _one(llm, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), {"prompt_token_ids": prompt})
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    hf = load_hf(tiny_llama_dir)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4
        assert entry[prompt[pos]].rank == int((ref[pos - 1] > ref[pos - 1, prompt[pos]]).sum()) + 1


def test_chunked_prompt_logprobs_are_complete(tiny_llama_dir):
    small = LLM(str(tiny_llama_dir), attention_backend="REFERENCE", max_num_batched_tokens=6, max_model_len=128)
    prompt = list(range(40, 60))
    out = _one(small, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0), {"prompt_token_ids": prompt})
    assert len(out.prompt_logprobs) == len(prompt)
    assert all(prompt[i] in out.prompt_logprobs[i] for i in range(1, len(prompt)))


def test_chat_uses_the_template(llm):
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": "hello world"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    expected = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    assert out.prompt_token_ids == list(expected)


def test_outputs_come_back_in_input_order(llm):
    prompts = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (30, 2, 15, 7)]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0) for m in (1, 9, 3, 5)],
                        use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 9, 3, 5]
