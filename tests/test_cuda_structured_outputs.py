"""Structured outputs on an NVIDIA GPU: the bitmask applied to the logits of CUDA-graph decode steps and of
eager ones, with overlapped scheduling (the GPU's default), in bfloat16 (GPU)."""

from __future__ import annotations

import gc
import json
import re

import pytest
import torch

from dovetail import LLM, SamplingParams, StructuredOutputsParams
from tiny_models import save_model, tiny_llama_config

jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.gpu

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
PROMPTS = ["hello world", "the quick brown fox", "1 + 2 = 3", "def f(x):"] * 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    config = tiny_llama_config(hidden_size=512, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    return save_model(tmp_path_factory.mktemp("tiny-llama-h128"), config)


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_constrained_rows_follow_their_grammar_beside_free_rows(model_dir, enforce_eager):
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.1, max_num_seqs=16,
              max_model_len=256, enforce_eager=enforce_eager)
    assert (llm.llm_engine.executor.worker.runner.graphs is None) == enforce_eager
    # Token 310 has logits but no text: biased up, it is every free row's greedy choice, and no constrained
    # row may take it. A mask on the wrong row, or none, shows at once.
    bias = {310: 100.0}
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=60, logit_bias=bias,
                                  structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
                   for i in range(4)]
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logit_bias=bias)
    outputs = llm.generate(PROMPTS, constrained + [free] * 4, use_tqdm=False)
    stopped = [o.outputs[0].text for o in outputs[:4] if o.outputs[0].finish_reason == "stop"]
    assert stopped, [o.outputs[0].text for o in outputs[:4]]
    for text in stopped:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert all(310 not in o.outputs[0].token_ids for o in outputs[:4])
    assert all(o.outputs[0].token_ids == [310] * 30 for o in outputs[4:])
    regex = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex="[0-9]{5}"))
    assert all(re.fullmatch("[0-9]{5}", o.outputs[0].text)
               for o in llm.generate(PROMPTS[:4], regex, use_tqdm=False))
