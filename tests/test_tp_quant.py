"""Quantized checkpoints (INT8, FP8, GPTQ, AWQ) through the engine's ``mp`` executor at TP=2: each worker
process holds its slices of the quantized tensors and the tokens match one rank's."""

from __future__ import annotations

import pytest

import tiny_models
from dovetail import LLM
from test_quant_checkpoints import (ENGINE, PROMPTS, TP_CHECKPOINTS, TP_PARAMS, TP_TOLERANCE, W8A8,  # noqa: F401
                                    float_dir)
from test_tp_engine import assert_ranks_agree

FORMATS = ("int8-static", "autofp8-static", "gptq-g32-actorder", "awq-g32")


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_checkpoint_at_tp2_through_worker_processes_matches_one_rank(float_dir, tmp_path, fmt):
    path, _ = TP_CHECKPOINTS[fmt](float_dir, tmp_path / fmt)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    single = LLM(str(path), **ENGINE)
    one = tiny_models.completions(single.generate(prompts, TP_PARAMS, use_tqdm=False))
    whole = single.llm_engine.executor.worker.describe()["parameters"]
    llm = LLM(str(path), tensor_parallel_size=2, **ENGINE)
    try:
        outputs = llm.generate(prompts, TP_PARAMS, use_tqdm=False)
        tol = TP_TOLERANCE["w8a8" if fmt in W8A8 else "weight-only"]  # why: test_quant_checkpoints.TP_TOLERANCE
        tiny_models.check_matches(tiny_models.completions(outputs), one, tol=tol)
        assert_ranks_agree(llm, outputs)
        for info in llm.llm_engine.executor.collective_rpc("describe"):
            qkv = {n: s for n, s in info["parameters"].items() if n.startswith("model.layers.0.self_attn.qkv_proj.")}
            assert any(s != whole[n] for n, s in qkv.items()), f"rank {info['rank']} holds the whole QKV projection"
    finally:
        llm.llm_engine.shutdown()
