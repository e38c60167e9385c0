"""Speculative decoding on an NVIDIA GPU (GPU): n-gram drafts leave the tokens as plain decoding gives them.

Float32 greedy tokens match HF; float32 greedy and seeded runs, with logprobs, equal the engine's own without
drafts (whose decode steps replay CUDA graphs, while the steps with drafts run eagerly), and bfloat16 greedy
ones up to ties within bfloat16's error.
"""

from __future__ import annotations

import pytest
import torch

from dovetail import LLM, SamplingParams
from test_speculative import NGRAM, PROMPTS, _KnowingProposer, _logprobs_close
from tiny_models import assert_greedy_matches, hf_greedy, load_hf, save_model, tiny_llama_config

pytestmark = pytest.mark.gpu

ENGINE = dict(device="cuda", gpu_memory_utilization=0.1, max_num_seqs=16, max_model_len=256)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    config = tiny_llama_config(hidden_size=512, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    return save_model(tmp_path_factory.mktemp("tiny-llama-h128"), config)


def _run(llm, params):
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def test_float32_greedy_with_drafts_matches_hf(model_dir):
    hf = load_hf(model_dir)
    references = [hf_greedy(hf, p, 24) for p in PROMPTS]
    llm = LLM(str(model_dir), dtype="float32", speculative_config=NGRAM, **ENGINE)
    llm.llm_engine.proposer = _KnowingProposer({(tuple(p), 0): r[0] for p, r in zip(PROMPTS, references)}, 4, 2)
    outputs = _run(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for (tokens, _), (hf_tokens, hf_logprobs) in zip(outputs, references):
        assert_greedy_matches(tokens, hf_tokens, hf_logprobs)
    assert llm.llm_engine.num_accepted_tokens > 0
    del llm
    torch.cuda.empty_cache()


def _with_drafts(model_dir, dtype, params, expected):
    llm = LLM(str(model_dir), dtype=dtype, speculative_config=NGRAM, **ENGINE)
    llm.llm_engine.proposer = _KnowingProposer(
        {(tuple(p), 0): tokens for p, (tokens, _) in zip(PROMPTS, expected)}, 4, 2)
    got = _run(llm, params)
    assert llm.llm_engine.num_accepted_tokens > 0
    del llm
    torch.cuda.empty_cache()
    return got


def _plain(model_dir, dtype, params):
    plain = LLM(str(model_dir), dtype=dtype, **ENGINE)
    expected = _run(plain, params)
    del plain
    torch.cuda.empty_cache()
    return expected


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.8, top_p=0.9, seed=4, max_tokens=32, ignore_eos=True, logprobs=1)],
    ids=["greedy", "seeded"])
def test_float32_outputs_with_drafts_equal_plain_decoding(model_dir, params):
    expected = _plain(model_dir, "float32", params)
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(_with_drafts(model_dir, "float32", params, expected),
                                                              expected):
        assert tokens == ref_tokens
        _logprobs_close(logprobs, ref_logprobs, tol=1e-3)


def test_bfloat16_greedy_with_drafts_follows_plain_decoding_up_to_ties(model_dir):
    """In bfloat16 a step with drafts multiplies more rows at once than a decode step (other kernels, other
    rounding: the logits are bfloat16, whose step is 1/16 between 8 and 16): tokens may part only where the
    plain run rates ours within two such steps of its own."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    expected = _plain(model_dir, "bfloat16", params)
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(_with_drafts(model_dir, "bfloat16", params, expected),
                                                              expected):
        step = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
        if step is None:
            assert tokens == ref_tokens
            continue
        best, ours = ref_logprobs[step], logprobs[step]
        where = f"step {step}: ours {tokens[:step + 1]} {ours}, plain {ref_tokens[:step + 1]} {best}"
        assert tokens[step] in best, where
        assert abs(best[tokens[step]].logprob - best[ref_tokens[step]].logprob) < 0.13, where


@pytest.mark.parametrize("proposer", ["ngram", "knowing"])
def test_steps_with_drafts_replay_graphs_and_keep_float32_greedy_tokens(model_dir, proposer):
    """TRITON captures speculative steps: with n-gram drafts (short proposals filled up), and with drafts that
    are the right continuation but for their third token, the steps replay their graphs, and the tokens stay
    those of plain decoding."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=1)
    expected = _plain(model_dir, "float32", params)
    llm = LLM(str(model_dir), dtype="float32", attention_backend="TRITON", speculative_config=NGRAM, **ENGINE)
    engine = llm.llm_engine
    graphs = engine.runner.verify_graphs
    assert graphs is not None and graphs.q == NGRAM["num_speculative_tokens"] + 1
    if proposer == "knowing":
        engine.proposer = _KnowingProposer({(tuple(p), 0): tokens for p, (tokens, _) in zip(PROMPTS, expected)},
                                           NGRAM["num_speculative_tokens"], 2)
    replays = []
    original = graphs.run
    graphs.run = lambda *a: replays.append(1) or original(*a)
    got = _run(llm, params)
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, expected):
        assert tokens == ref_tokens
        _logprobs_close(logprobs, ref_logprobs, tol=1e-3)
    counts = (len(replays), engine.num_draft_tokens, engine.num_accepted_tokens)
    assert replays and engine.num_draft_tokens > 0, counts
    if proposer == "knowing":
        assert engine.num_accepted_tokens > 0, counts
    del llm, engine
    torch.cuda.empty_cache()
