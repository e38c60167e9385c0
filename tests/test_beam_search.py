"""``LLM.beam_search`` against HF transformers' beam search and against the same algorithm run on HF's
logprobs, on the same weights."""

from __future__ import annotations

import pytest
import torch

import tiny_models
from dovetail import LLM, BeamSearchParams
from dovetail.beam_search import beam_score
from dovetail.errors import RequestError

COMMON = dict(device="cpu", dtype="float32", max_model_len=64)
PROMPTS = [[5, 17, 33, 2, 90], [44, 45, 46]]


def test_without_eos_the_beams_are_hf_beam_searchs(tiny_llama_dir, tiny_llama_hf):
    llm, hf = LLM(str(tiny_llama_dir), **COMMON), tiny_llama_hf
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, output in zip(PROMPTS, outputs):
        expected = hf.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3, do_sample=False,
                               max_new_tokens=6, eos_token_id=None, pad_token_id=0, early_stopping=False,
                               output_scores=True, return_dict_in_generate=True)
        ours = [s.tokens for s in output.sequences]
        assert ours == expected.sequences.tolist()
        # HF's score is the cumulative logprob over the generated length (all beams are 6 tokens long).
        assert [s.cum_logprob for s in output.sequences] == pytest.approx(
            (expected.sequences_scores * 6).tolist(), abs=1e-3)
        assert all(s.finish_reason == "length" and len(s.logprobs) == 6 for s in output.sequences)


def reference_beam_search(hf, prompt: list[int], width: int, max_tokens: int, eos: set[int],
                          length_penalty: float) -> list[tuple[list[int], float]]:
    """vLLM's algorithm on HF's logprobs: extend every beam by its 2 * width best tokens, set aside the ones
    ending in EOS, keep the width best others by length-penalised score."""
    def score(tokens, cum):
        return cum / ((len(tokens) - (tokens[-1] in eos)) ** length_penalty)

    beams, completed = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in beams:
            with torch.no_grad():
                logprobs = torch.log_softmax(hf(torch.tensor([tokens])).logits[0, -1].float(), dim=-1)
            top = logprobs.topk(2 * width)
            for lp, token in zip(top.values.tolist(), top.indices.tolist()):
                (completed if token in eos else candidates).append((tokens + [token], cum + lp))
        beams = sorted(candidates, key=lambda b: score(*b), reverse=True)[:width]
    return sorted(completed + beams, key=lambda b: score(*b), reverse=True)[:width]


def test_beams_that_end_in_eos_are_set_aside_and_ranked_with_a_length_penalty(tmp_path):
    config = tiny_models.tiny_llama_config(eos_token_id=73)  # a token some of this model's beams pick
    path = tiny_models.save_model(tmp_path / "eos-73", config)
    hf, llm = tiny_models.load_hf(path), LLM(str(path), **COMMON)
    params = BeamSearchParams(beam_width=2, max_tokens=5, length_penalty=0.5)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    finishes = set()
    for prompt, output in zip(PROMPTS, outputs):
        expected = reference_beam_search(hf, prompt, 2, 5, {73}, 0.5)
        assert [s.tokens for s in output.sequences] == [tokens for tokens, _ in expected]
        assert [s.cum_logprob for s in output.sequences] == pytest.approx([cum for _, cum in expected], abs=1e-4)
        for s in output.sequences:
            finishes.add(s.finish_reason)
            assert s.finish_reason == ("stop" if s.tokens[-1] == 73 else "length")
            assert beam_score(s, {73}, 0.5) == pytest.approx(s.cum_logprob / (len(s.tokens) - (s.tokens[-1] == 73))
                                                             ** 0.5)
            assert s.text == llm.get_tokenizer().decode(
                s.tokens[len(prompt):len(s.tokens) - (s.finish_reason == "stop")], skip_special_tokens=True)
    assert finishes == {"stop", "length"}, "the test needs beams of both kinds"


def test_bad_parameters_are_named(tiny_llama_dir):
    for kwargs, field in [(dict(beam_width=11, max_tokens=4), "beam_width"),
                          (dict(beam_width=2, max_tokens=0), "max_tokens")]:
        with pytest.raises(RequestError) as caught:
            BeamSearchParams(**kwargs)
        assert caught.value.field == field
    llm = LLM(str(tiny_llama_dir), **COMMON)
    with pytest.raises(RequestError, match="max_tokens: the prompt .* exceeds max_model_len"):
        llm.beam_search([{"prompt_token_ids": list(range(1, 60))}], BeamSearchParams(beam_width=2, max_tokens=8))
