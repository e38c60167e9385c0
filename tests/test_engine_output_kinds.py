"""RequestOutputKind: cumulative, delta and final-only outputs carry the same text."""

from __future__ import annotations

import pytest

from dovetail import LLM, SamplingParams
from dovetail.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), attention_backend="REFERENCE", max_model_len=128).llm_engine


def _run(engine, kind, **extra):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=kind, **extra)
    engine.add_request(f"req-{kind.name}-{len(extra)}", "hello world, the quick", params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_final_only_gives_one_output_with_the_same_text(engine):
    cumulative = _run(engine, RequestOutputKind.CUMULATIVE)
    final = _run(engine, RequestOutputKind.FINAL_ONLY)
    assert len(cumulative) == 12 and len(final) == 1 and final[0].finished
    assert final[0].outputs[0].text == cumulative[-1].outputs[0].text
    assert final[0].outputs[0].token_ids == cumulative[-1].outputs[0].token_ids


def test_delta_outputs_concatenate_to_the_whole(engine):
    cumulative = _run(engine, RequestOutputKind.CUMULATIVE)
    deltas = _run(engine, RequestOutputKind.DELTA)
    assert "".join(o.outputs[0].text for o in deltas) == cumulative[-1].outputs[0].text
    assert sum((o.outputs[0].token_ids for o in deltas), []) == cumulative[-1].outputs[0].token_ids
    assert all(len(o.outputs[0].token_ids) == 1 for o in deltas)


def test_final_only_text_excludes_the_stop_token(engine):
    out = _run(engine, RequestOutputKind.FINAL_ONLY, stop_token_ids=[55], logit_bias={55: 100.0})[0]
    streamed = _run(engine, RequestOutputKind.CUMULATIVE, stop_token_ids=[55], logit_bias={55: 100.0})[-1]
    assert out.outputs[0].token_ids == [55] and out.outputs[0].text == "" == streamed.outputs[0].text
