"""Tensor parallelism end to end on the CPU: one worker process per rank (``mp``) talking over gloo.

Greedy tokens at TP=2 (and TP=4 for one model) must match HF and one rank; every
rank must hold the same tokens as the engine reports (the ranks sample
identically); the engine's features (chunked prefill, preemption, prefix
caching, logprobs, prompt logprobs, penalties, seeds, ``n``) must give at TP=2
what they give at TP=1.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import time

import pytest

from dovetail import LLM, SamplingParams
from dovetail.executor.uni import UniProcExecutor
from test_models_vs_hf import CASES, save_checkpoint
from tiny_models import assert_greedy_matches, hf_greedy, load_hf

PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 47)), [42, 17] * 9 + [3]]
MAX_TOKENS = 8
COMMON = dict(device="cpu", attention_backend="REFERENCE", dtype="float32", max_model_len=128)


def _greedy(llm: LLM, prompts=PROMPTS, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def assert_ranks_agree(llm: LLM, outputs=None) -> None:
    """Every rank holds the same tokens for every request (and, given ``outputs``, the engine's)."""
    digests = llm.llm_engine.executor.collective_rpc("token_digest")
    assert len(digests) == llm.llm_engine.world_size
    for rank, digest in enumerate(digests[1:], start=1):
        assert digest == digests[0], f"rank {rank} holds other tokens than rank 0"
    for out in outputs or []:
        for c in out.outputs:
            rid = out.request_id if len(out.outputs) == 1 else f"{out.request_id}#{c.index}"
            if rid in digests[0]:
                assert digests[0][rid] == out.prompt_token_ids + c.token_ids


def assert_workers_gone(pids: list[int]) -> None:
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        assert state == "Z", f"worker process {pid} is still running (state {state})"


def kill_rank_one_mid_generation(engine) -> list[int]:
    """Start a 90-token request on ``engine`` (TP=2), run three steps, SIGKILL rank 1; every rank's pid."""
    import signal

    pids = engine.executor.pids
    engine.add_request("long", {"prompt_token_ids": list(range(10, 40))},
                       SamplingParams(temperature=0, max_tokens=90, ignore_eos=True))
    for _ in range(3):
        engine.step()
    os.kill(pids[1], signal.SIGKILL)
    return pids


def assert_sharded(whole: dict, ranks: list[dict]) -> None:
    """Each rank holds a part of the large weights (attention, dense MLP, embedding): a parameter is either
    the whole one or smaller in one dimension, by about the number of ranks."""
    world = len(ranks)
    for info in ranks:
        parts = info["parameters"]
        assert parts.keys() == whole.keys()
        split = []
        for name, shape in parts.items():
            if shape == whole[name]:
                continue
            dims = [d for d, (a, b) in enumerate(zip(shape, whole[name])) if a != b]
            assert len(dims) == 1 and shape[dims[0]] * world >= whole[name][dims[0]] > shape[dims[0]], \
                f"rank {info['rank']}: {name} is {shape}, the whole is {whole[name]}"
            split.append(name)
        kinds = ["qkv_proj", "o_proj", "embed_tokens"] + (["gate_up_proj", "down_proj"] if any(
            "gate_up_proj" in name for name in whole) else [])  # experts are checked where they are split
        for kind in kinds:
            assert any(kind in name for name in split), f"rank {info['rank']} holds every {kind} whole"


def check_against_hf_and_one_rank(path, world_size: int = 2) -> LLM:
    hf = load_hf(path)
    references = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    single = LLM(str(path), **COMMON)
    one = _greedy(single)
    llm = LLM(str(path), tensor_parallel_size=world_size, **COMMON)
    assert llm.llm_engine.executor.name == "mp" and llm.llm_engine.world_size == world_size
    ranks = llm.llm_engine.executor.collective_rpc("describe")
    assert_sharded(single.llm_engine.executor.worker.describe()["parameters"], ranks)
    # Each rank's own process freezes its heap once the rank is up; an in-process rank only while generating.
    assert all(info["heap_frozen"] for info in ranks)
    assert not single.llm_engine.executor.worker.describe()["heap_frozen"]
    many = _greedy(llm)
    for ours, single, (tokens, logprobs) in zip(many, one, references):
        assert_greedy_matches(ours, tokens, logprobs)
        assert_greedy_matches(ours, single, logprobs)
    assert_ranks_agree(llm)
    return llm


@pytest.mark.parametrize("case", ["llama-tied-head_dim-bias", "mistral-sliding-odd-vocab", "qwen2-bias-sliding-layer",
                                  "qwen3-qknorm-head_dim", "gemma2-softcap-sliding", "gemma3-local-rope-qknorm",
                                  "phi3-fused-sliding-partial-rotary", "mixtral-sliding",
                                  "qwen2moe-shared-expert-dense-layer", "qwen3moe-normtopk-dense-layer"])
def test_tp2_greedy_matches_hf_and_one_rank(case, tmp_path):
    """Every architecture of the zoo at TP=2 (Phi-3's fused checkpoint tensors, Qwen2-MoE's shared expert and
    Gemma's soft-capping and q/k norms included)."""
    llm = check_against_hf_and_one_rank(save_checkpoint(tmp_path, CASES[case]()))
    pids = llm.llm_engine.executor.pids
    llm.llm_engine.shutdown()
    assert_workers_gone(pids)


def test_tp4_greedy_matches_hf_and_one_rank(tmp_path):
    """Four ranks for a model with two KV heads: the KV heads are shared by pairs of ranks."""
    config = CASES["llama-rope-llama3"]()
    llm = check_against_hf_and_one_rank(save_checkpoint(tmp_path, config), world_size=4)
    head, hidden = config.hidden_size // config.num_attention_heads, config.hidden_size
    for info in llm.llm_engine.executor.collective_rpc("describe"):  # each rank: one query head, one KV head
        shapes = info["parameters"]
        assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (3 * head, hidden)
        assert shapes["model.layers.0.self_attn.o_proj.weight"] == (hidden, head)
        assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (2 * config.intermediate_size // 4, hidden)
        assert shapes["model.embed_tokens.weight"] == (config.vocab_size // 4, hidden)
    pids = llm.llm_engine.executor.pids
    del llm  # an engine dropped without shutdown() stops its workers too
    gc.collect()
    deadline = time.monotonic() + 20
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert_workers_gone(pids)


def test_one_rank_runs_in_process(tiny_llama_dir):
    before = {p.pid for p in multiprocessing.active_children()}  # other tests' rank groups may live on
    llm = LLM(str(tiny_llama_dir), **COMMON)
    assert isinstance(llm.llm_engine.executor, UniProcExecutor) and llm.llm_engine.executor_name == "uni"
    assert {p.pid for p in multiprocessing.active_children()} <= before, "one rank starts no process"
    assert llm.llm_engine.model is llm.llm_engine.executor.worker.model


@pytest.fixture(scope="module")
def feature_pair(tiny_llama_dir):
    """One rank and two, each with a small token budget (chunked prefill) and a KV cache that preempts."""
    kwargs = dict(COMMON, max_num_batched_tokens=32, max_num_seqs=6, num_gpu_blocks_override=16, block_size=8)
    one = LLM(str(tiny_llama_dir), **kwargs)
    two = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **kwargs)
    yield one, two
    two.llm_engine.shutdown()


def test_engine_features_at_tp2_match_one_rank(feature_pair):
    one, two = feature_pair
    shared = list(range(30, 70))  # two requests share a prefix: the second one hits the prefix cache
    prompts = [{"prompt_token_ids": p} for p in (shared + [3, 4], shared + [9], list(range(100, 150)), [7, 8, 9])]
    params = [SamplingParams(temperature=0, max_tokens=20, logprobs=3, prompt_logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=18, repetition_penalty=1.5, presence_penalty=0.4,
                             frequency_penalty=0.2, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=24, min_tokens=4, ignore_eos=True)]
    a = one.generate(prompts, params, use_tqdm=False)
    b = two.generate(prompts, params, use_tqdm=False)
    assert two.llm_engine.scheduler.num_preemptions > 0, "the small KV cache must preempt"
    assert two.llm_engine.kv_manager.prefix_hits > 0
    for x, y in zip(a, b):
        assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
        assert [c.text for c in x.outputs] == [c.text for c in y.outputs]
    for lx, ly in zip(a[0].outputs[0].logprobs, b[0].outputs[0].logprobs):
        assert lx.keys() == ly.keys()
        assert all(abs(lx[t].logprob - ly[t].logprob) < 1e-4 for t in lx)
    px, py = a[0].prompt_logprobs, b[0].prompt_logprobs
    assert px[0] is None and py[0] is None and len(px) == len(py) == len(prompts[0]["prompt_token_ids"])
    for lx, ly in zip(px[1:], py[1:]):
        assert lx.keys() == ly.keys() and all(abs(lx[t].logprob - ly[t].logprob) < 1e-4 for t in lx)
    assert_ranks_agree(two, b)


def test_unseeded_sampling_is_identical_on_every_rank(feature_pair):
    _, two = feature_pair
    params = SamplingParams(temperature=1.2, top_p=0.95, n=3, max_tokens=12, ignore_eos=True)
    outputs = two.generate([{"prompt_token_ids": [11, 12, 13]}, {"prompt_token_ids": [50] * 9}], params,
                           use_tqdm=False)
    assert_ranks_agree(two, outputs)
    assert len({tuple(c.token_ids) for c in outputs[0].outputs}) > 1, "random rows should differ"


def test_async_scheduling_across_processes(tiny_llama_dir, caplog):
    """Overlapped steps: each worker feeds its rows the tokens it sampled a step before, on the device."""
    kwargs = dict(COMMON, async_scheduling=True)
    sync_tokens = _greedy(LLM(str(tiny_llama_dir), **COMMON), max_tokens=12)
    with caplog.at_level(logging.INFO, logger="dovetail"):
        llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **kwargs)
    assert "world size 2 (executor mp)" in caplog.text, "the start-up log says the world size and the executor"
    phases = llm.llm_engine.startup_phases
    assert list(phases) == ["config_s", "workers_and_weights_s", "memory_profile_s", "kv_cache_and_graphs_s"]
    assert all(s >= 0 for s in phases.values()) and sum(phases.values()) <= llm.llm_engine.startup_seconds
    assert phases["workers_and_weights_s"] > 0.1, "starting two workers and loading their shards takes time"
    assert "start-up: config " in caplog.text and "kv cache and graphs " in caplog.text
    ranks = llm.llm_engine.worker_startup_phases
    assert len(ranks) == 2 and all(list(r) == ["process_start_s", "spec_wait_s", "device_and_group_s",
                                               "all_reduce_setup_s", "model_config_s", "model_build_s", "weights_s",
                                               "runner_s"] for r in ranks)
    assert all(s >= 0 for r in ranks for s in r.values())
    assert min(r["process_start_s"] for r in ranks) > 0, "a rank imports Dovetail's engine and reads the config first"
    slowest = llm.llm_engine.slowest_rank_startup()
    building = sum(v for k, v in slowest.items() if k not in ("process_start_s", "spec_wait_s"))
    assert slowest in ranks and building <= phases["workers_and_weights_s"] + 0.02
    assert "the slowest rank's: process start " in caplog.text
    assert llm.llm_engine.overlap
    assert _greedy(llm, max_tokens=12) == sync_tokens
    params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[sync_tokens[1][3]])
    out = llm.generate({"prompt_token_ids": PROMPTS[1]}, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == sync_tokens[1][:4] and out.outputs[0].finish_reason == "stop"
    llm.llm_engine.shutdown()


def test_dual_batch_overlap_across_processes(tiny_llama_dir):
    """Steps split into two micro-batches at TP=2, with overlapped scheduling (decode rows read their last token
    from the device): both ranks issue the parts' collectives in one order, and the tokens are one rank's."""
    kwargs = dict(COMMON, max_num_batched_tokens=32, async_scheduling=True)
    prompts = [list(range(3, 13)), list(range(50, 62)), [7, 8, 9] * 5, PROMPTS[0]]  # 10 + 12 + 10 of 15, ...
    one = _greedy(LLM(str(tiny_llama_dir), **kwargs), prompts, max_tokens=12)
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, enable_dbo=True, dbo_prefill_token_threshold=8, **kwargs)
    assert _greedy(llm, prompts, max_tokens=12) == one
    assert all(info["micro_batched_steps"] > 0 for info in llm.llm_engine.executor.collective_rpc("describe"))
    assert_ranks_agree(llm)
    llm.llm_engine.shutdown()


def test_worker_processes_report_their_pids(feature_pair):
    _, two = feature_pair
    pids = two.llm_engine.executor.pids
    assert len(pids) == 2 and os.getpid() not in pids
    assert all(os.path.exists(f"/proc/{pid}") for pid in pids)


def test_benchmarks_name_the_all_reduce_they_ran_with(feature_pair):
    """Figures at several ranks depend on the sum's kernel, which ``auto`` picks by machine: the bench commands
    record rank 0's (on the CPU gloo's own, "backend"; none at one rank)."""
    from dovetail.bench.common import all_reduce_kernel

    one, two = feature_pair
    assert all_reduce_kernel(two.llm_engine) == "backend"
    assert all_reduce_kernel(one.llm_engine) is None


def test_a_token_bitmask_reaches_every_rank(feature_pair):
    """The per-row bitmask of structured outputs travels with the step to each worker process."""
    import torch

    _, two = feature_pair
    engine = two.llm_engine
    describe, only = engine.describe_step, (17, 250)

    def constrained(batch):
        step = describe(batch)
        rows = sum(1 for r, n in zip(batch.requests, batch.num_new_tokens) if r.num_computed_tokens + n == r.num_tokens)
        step.token_bitmask = torch.zeros(rows, -(-engine.vocab_size // 32), dtype=torch.int32)
        for token in only:
            step.token_bitmask[:, token // 32] |= 1 << (token % 32)
        return step

    engine.describe_step = constrained
    try:
        out = two.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=1.0, max_tokens=10,
                                                                             ignore_eos=True), use_tqdm=False)
    finally:
        del engine.describe_step
    assert set(out[0].outputs[0].token_ids) <= set(only) and len(out[0].outputs[0].token_ids) == 10
    assert_ranks_agree(two, out)


def test_structured_outputs_across_processes_with_overlapped_steps(tiny_llama_dir):
    """Grammars at TP=2, overlapped: the workers run each step's model while the engine applies the step
    before and builds the bitmask, which follows to every rank; the outputs are those of one rank."""
    from dovetail import StructuredOutputsParams

    spec = StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}, "ok": {
        "type": "boolean"}}, "required": ["n", "ok"]}, disable_any_whitespace=True)
    prompts = ["hello world", "the quick brown fox", "1 + 2 = 3"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=30, structured_outputs=spec) for i in range(3)]
    params.append(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))  # a free row beside them
    kwargs = dict(COMMON, async_scheduling=True)
    one = [o.outputs[0].token_ids for o in LLM(str(tiny_llama_dir), **kwargs).generate(
        prompts + ["hello"], params, use_tqdm=False)]
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **kwargs)
    executor, deferred = llm.llm_engine.executor, []
    sample_with_bitmask = executor.sample_with_bitmask
    executor.sample_with_bitmask = lambda *args: (deferred.append(args), sample_with_bitmask(*args))
    try:
        outputs = llm.generate(prompts + ["hello"], params, use_tqdm=False)
        assert deferred, "decode steps of constrained rows send their bitmask after the model runs"
        assert [o.outputs[0].token_ids for o in outputs] == one
        assert any(o.outputs[0].finish_reason == "stop" for o in outputs[:3])
        assert_ranks_agree(llm)  # (a request that stopped may hold one more token there, sampled before it stopped)
    finally:
        llm.llm_engine.shutdown()


def test_the_engine_process_pins_no_memory_for_ranks_it_does_not_drive(tiny_llama_dir, monkeypatch):
    """On an accelerator, the mp engine's structured-output bitmasks go to the ranks by IPC: pinning them in the
    engine's process would open a device context there (on the first GPU) for nothing."""
    probe = LLM(str(tiny_llama_dir), **COMMON)
    platform_class = type(probe.llm_engine.platform)
    assert not probe.llm_engine.structured.pin_memory  # no accelerator: nothing to pin
    probe.llm_engine.shutdown()
    monkeypatch.setattr(platform_class, "is_accelerator", True)  # the engine's process only: ranks are spawned
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, async_scheduling=False, **COMMON)
    try:
        assert llm.llm_engine.executor.name == "mp" and not llm.llm_engine.structured.pin_memory
    finally:
        llm.llm_engine.shutdown()
