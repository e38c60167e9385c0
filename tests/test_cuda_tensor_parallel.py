"""Tensor parallelism on two (and, where the host has them, four) NVIDIA GPUs through the engine (``mp``,
NCCL): greedy float32 tokens against HF and one GPU, with the decode steps replayed from CUDA graphs (GPU)."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from dovetail import LLM, SamplingParams
from test_models_vs_hf import _config, save_checkpoint
from tiny_models import assert_greedy_matches, hf_greedy, load_hf, tiny_llama_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two NVIDIA GPUs")]

PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 61)), [3], list(range(100, 117)), [42] * 33]
MAX_TOKENS = 16
ENGINE = dict(device="cuda", dtype="float32", attention_backend="TRITON", gpu_memory_utilization=0.3,
              max_num_seqs=8, max_model_len=256)
#: Head size 128 (every CUDA backend takes it); four heads divide among two or four GPUs, and the two KV
#: heads are split between two GPUs or each held by two of four.
MODELS = {
    "llama": lambda: tiny_llama_config(hidden_size=512, intermediate_size=512, num_attention_heads=4,
                                       num_key_value_heads=2),
    "qwen3-moe": lambda: _config("Qwen3MoeConfig", hidden_size=512, head_dim=128, num_experts=4,
                                 num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True),
}


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("split", [False, True], ids=["whole", "micro-batches"])
@pytest.mark.parametrize("tp", [2, 4], ids=["tp2", "tp4"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_tp_greedy_matches_hf_and_one_gpu_with_graphs(name, tp, split, tmp_path):
    """With ``micro-batches`` the prefill step runs as two parts on two streams (dual-batch overlap)."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} NVIDIA GPUs")
    path = save_checkpoint(tmp_path, MODELS[name]())
    hf = load_hf(path)
    references = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    del hf
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    one = LLM(str(path), **ENGINE)
    single = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    del one
    gc.collect()
    torch.cuda.empty_cache()
    dbo = dict(enable_dbo=True, dbo_prefill_token_threshold=16) if split else dict(enable_dbo=False)
    llm = LLM(str(path), tensor_parallel_size=tp, **dbo, **ENGINE)
    try:
        info = llm.llm_engine.executor.collective_rpc("describe")
        assert [i["device"] for i in info] == [f"cuda:{rank}" for rank in range(tp)]
        assert all(i["graph_sizes"] for i in info), "decode graphs stay on under tensor parallelism"
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for out, mine, (tokens, logprobs) in zip(outputs, single, references):
            assert_greedy_matches(out.outputs[0].token_ids, tokens, logprobs)
            assert_greedy_matches(out.outputs[0].token_ids, mine, logprobs)
        digests = llm.llm_engine.executor.collective_rpc("token_digest")
        assert all(digest == digests[0] for digest in digests[1:])
        steps = [i["micro_batched_steps"] for i in llm.llm_engine.executor.collective_rpc("describe")]
        assert all(steps) if split else not any(steps)
    finally:
        llm.llm_engine.shutdown()


def test_tp2_random_sampling_is_identical_on_both_gpus(tmp_path):
    path = save_checkpoint(tmp_path, MODELS["llama"]())
    llm = LLM(str(path), tensor_parallel_size=2, async_scheduling=True, **ENGINE)
    try:
        params = SamplingParams(temperature=1.0, top_p=0.9, n=4, max_tokens=MAX_TOKENS, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        digests = llm.llm_engine.executor.collective_rpc("token_digest")
        assert digests[0] == digests[1]
    finally:
        llm.llm_engine.shutdown()


def test_ray_tp2_shows_each_actor_both_gpus_and_matches_hf_and_mp(tmp_path):
    """Ray gives each actor one GPU; the executor shows it both (its node's ranks'), so the all-reduce kernel is
    the one the ``mp`` executor picks (NVLink's where the GPUs have it), and bfloat16 tokens equal ``mp``'s."""
    pytest.importorskip("ray", reason="the ray executor needs Ray (pip install 'dovetail[ray]')")
    path = save_checkpoint(tmp_path, MODELS["llama"]())
    hf = load_hf(path)
    references = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    del hf
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    runs = {}
    for backend, dtype in (("ray", "float32"), ("mp", "bfloat16"), ("ray", "bfloat16")):
        llm = LLM(str(path), tensor_parallel_size=2, distributed_executor_backend=backend,
                  **{**ENGINE, "dtype": dtype})
        try:
            assert llm.llm_engine.executor.name == backend
            info = llm.llm_engine.executor.collective_rpc("describe")
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            runs[backend, dtype] = tokens, info
        finally:
            llm.llm_engine.shutdown()
        gc.collect()
        torch.cuda.empty_cache()
    tokens, info = runs["ray", "float32"]
    assert [i["device"] for i in info] == ["cuda:0", "cuda:1"] and [i["visible_devices"] for i in info] == [2, 2]
    for mine, (reference, logprobs) in zip(tokens, references):
        assert_greedy_matches(mine, reference, logprobs)
    (mp_tokens, mp_info), (ray_tokens, ray_info) = runs["mp", "bfloat16"], runs["ray", "bfloat16"]
    assert [i["all_reduce"] for i in ray_info] == [i["all_reduce"] for i in mp_info]
    if not os.environ.get("OMP_NUM_THREADS"):
        assert [i["host_threads"] for i in mp_info] == [1, 1]
    assert ray_tokens == mp_tokens
