"""The ``ray`` executor at TP=2 on the CPU with a local Ray cluster: greedy tokens as one rank, ranks agree."""

from __future__ import annotations

import pytest

from dovetail import LLM, SamplingParams
from dovetail.errors import ConfigError
from test_tp_engine import COMMON, PROMPTS, _greedy, assert_ranks_agree

ray = pytest.importorskip("ray", reason="the ray executor needs Ray (pip install 'dovetail[ray]')")


def test_ray_tp2_matches_one_rank(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    one = _greedy(LLM(str(tiny_llama_dir), **COMMON))
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, distributed_executor_backend="ray", **COMMON)
    try:
        engine = llm.llm_engine
        assert engine.executor.name == "ray" and engine.executor_name == "ray" and len(engine.executor.pids) == 2
        assert _greedy(llm) == one
        params = SamplingParams(temperature=1.0, seed=5, max_tokens=6, logprobs=2, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert all(len(o.outputs[0].logprobs) == 6 for o in outputs)
        assert_ranks_agree(llm, outputs)
        cpus = int(ray.cluster_resources()["CPU"])
        if cpus < 4:  # the model's four heads allow four ranks at most
            with pytest.raises(ConfigError, match=rf"^tensor_parallel_size: 4 ranks need 4 CPU in the Ray cluster, "
                                                  rf"but it has {cpus}$"):
                LLM(str(tiny_llama_dir), tensor_parallel_size=4, distributed_executor_backend="ray", **COMMON)
    finally:
        llm.llm_engine.shutdown()
    assert not ray.is_initialized(), "the engine stops the local Ray it started"
