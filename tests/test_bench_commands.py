"""``dovetail bench throughput`` and ``bench latency`` end to end on the CPU, on a tiny model directory."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from dovetail.bench.throughput import workload
from dovetail.bench.workload import b1_requests, greedy_inputs, random_requests
from dovetail.cli.main import build_parser, main


def test_b1_is_the_peers_request_list():
    requests = b1_requests(128256)
    rng = random.Random(0)
    pairs = [(rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(256)]
    assert [(len(r.prompt_token_ids), r.output_len) for r in requests] == pairs
    assert sum(r.output_len for r in requests) == 140_797
    assert sum(len(r.prompt_token_ids) for r in requests) == 148_194
    ids = random.Random(1)
    assert requests[0].prompt_token_ids == [ids.randrange(10, 128256 - 10) for _ in range(pairs[0][0])]
    assert requests[1].prompt_token_ids == [ids.randrange(10, 128256 - 10) for _ in range(pairs[1][0])]


def test_throughput_runs_b1_on_every_gpu_shape_and_c1_on_c1():
    for model in ("qwen3-0.6b", "llama-3.1-8b", "qwen3-32b", "llama-3.1-70b"):
        args = build_parser().parse_args(["bench", "throughput", "--model", model])
        requests, _, _ = workload(args, 151936)
        assert [(len(r.prompt_token_ids), r.output_len) for r in requests] == \
            [(len(r.prompt_token_ids), r.output_len) for r in b1_requests(151936)]
    args = build_parser().parse_args(["bench", "throughput", "--model", "c1"])
    requests, in_range, out_range = workload(args, 32000)
    assert len(requests) == 64 and (in_range, out_range) == ((64, 256), (64, 128))
    assert all(64 <= len(r.prompt_token_ids) <= 256 and 64 <= r.output_len <= 128 for r in requests)


def test_greedy_inputs_ask_for_each_requests_output_length():
    requests = random_requests(3, (4, 9), (2, 5), 100, seed=1)
    prompts, params = greedy_inputs(requests)
    assert [p["prompt_token_ids"] for p in prompts] == [r.prompt_token_ids for r in requests]
    assert [(p.temperature, p.ignore_eos, p.max_tokens) for p in params] == [(0, True, r.output_len) for r in requests]


def test_throughput_generates_every_requested_token(tiny_llama_dir, tmp_path):
    out = tmp_path / "throughput.json"
    rc = main(["--log-level", "WARNING", "bench", "throughput", "--model", str(tiny_llama_dir), "--device", "cpu",
               "--num-prompts", "5", "--input-len", "8:20", "--output-len", "3:9", "--output-json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    requests = random_requests(5, (8, 20), (3, 9), vocab, seed=0)
    wanted = sum(r.output_len for r in requests)
    assert result["num_requests"] == 5 and result["dovetail"]["output_tokens"] == wanted
    assert result["dovetail"]["output_tokens_per_s"] > 0
    assert result["dovetail"]["kv_cache_blocks_per_rank"] > 0 and result["dovetail"]["world_size"] == 1
    assert result["dovetail"]["executor"] == "uni" and result["dovetail"]["all_reduce"] is None


def test_step_stats_charge_every_step_of_the_timed_run(tiny_llama_dir, tmp_path):
    out = tmp_path / "throughput.json"
    rc = main(["--log-level", "WARNING", "bench", "throughput", "--model", str(tiny_llama_dir), "--device", "cpu",
               "--num-prompts", "6", "--input-len", "8:20", "--output-len", "3:9", "--max-num-batched-tokens", "32",
               "--step-stats", "--output-json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())["dovetail"]
    stats = result["step_stats"]
    groups = stats["groups"]
    # Every prompt token is in a prefill step; each request's first token comes from its prefill, the rest
    # from decode tokens; a 32-token budget splits these prompts over several steps.
    assert sum(g["prompt_tokens"] for g in groups.values()) == result["prompt_tokens"]
    assert groups["prefill"]["steps"] > 1
    assert sum(g["decode_tokens"] for g in groups.values()) == result["output_tokens"] - 6
    assert stats["steps"] == sum(g["steps"] for g in groups.values())
    assert 0 < sum(g["seconds"] for g in groups.values()) <= stats["seconds"] <= result["seconds"]
    assert all(name == "prefill" or name.startswith("decode ") for name in groups)
    assert set(stats["stalls"]) == {"steps", "extra_seconds", "longest"}
    # What grew in the engine's process and in its one rank (the same process here) over the timed run.
    engine, [rank] = stats["counters"]["engine"], stats["counters"]["ranks"]
    assert set(stats["counters"]["host"]) <= {"compaction_stalls", "reclaim_stalls", "huge_page_faults"}
    for counted in (engine, rank):
        assert counted["cpu_s"] > 0 and counted["minor_faults"] >= 0
        assert counted["gc_collections"] >= 0 and counted["involuntary_switches"] >= 0


def test_process_counters_count_what_the_process_did_between_two_reads():
    import gc
    import mmap

    from dovetail.bench.step_stats import _format_counters
    from dovetail.engine.process_counters import counters_since, process_counters

    before = process_counters()
    gc.collect()
    with mmap.mmap(-1, 64 << 20) as fresh:  # pages of its own, each faulted in as it is first written
        for offset in range(0, len(fresh), mmap.PAGESIZE):
            fresh[offset] = 1
    grown = counters_since(before, process_counters())
    assert grown["gc_collections"] >= 1 and grown["minor_faults"] >= 1000 and grown["cpu_s"] >= 0
    text = _format_counters({**grown, "alloc_retries": 2})
    assert f"{grown['gc_collections']:,.0f} collections" in text and "2 allocator retries" in text


def test_step_stats_find_a_decode_step_that_waited_longer_than_its_neighbours():
    from dovetail.bench.step_stats import stalls

    rng = random.Random(3)
    # Steps slowly getting shorter as the batch shrinks, with some noise; step 30 waited 12 ms more.
    decodes = [(i, 256 - i, 0.009 - 2e-5 * i + rng.uniform(-2e-4, 2e-4), float(i)) for i in range(60)]
    assert stalls(decodes)["steps"] == 0
    decodes[30] = (30, 226, decodes[30][2] + 0.012, 30.0)
    found = stalls(decodes)
    assert found["steps"] == 1
    [stall] = found["longest"]
    assert (stall["step"], stall["sequences"], stall["ended_at"]) == (30, 226, 30.0)
    assert abs(found["extra_seconds"] - 0.012) < 5e-4


def test_host_counters_read_the_kernels_memory_stalls_and_huge_page_setting(tmp_path):
    from dovetail.bench.step_stats import format_summary
    from dovetail.engine.process_counters import host_counters, transparent_huge_pages

    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 100\ncompact_stall 7\ncompact_fail 2\nallocstall_dma 1\nallocstall_normal 4\n"
                      "allocstall_movable 2\nthp_fault_alloc 30\nthp_fault_fallback 3\n")
    assert host_counters(vmstat) == {"compaction_stalls": 7, "reclaim_stalls": 7, "huge_page_faults": 30}
    assert host_counters(tmp_path / "missing") == {}
    thp = tmp_path / "thp"
    thp.mkdir()
    (thp / "enabled").write_text("[always] madvise never\n")
    (thp / "defrag").write_text("always defer defer+madvise [madvise] never\n")
    assert transparent_huge_pages(thp) == "always, defrag madvise"
    assert transparent_huge_pages(tmp_path / "none") is None
    summary = {"seconds": 1.0, "steps": 0, "groups": {}, "stalls": {"steps": 0},
               "counters": {"host": {"compaction_stalls": 3, "reclaim_stalls": 0, "huge_page_faults": 12},
                            "transparent_huge_pages": "always, defrag madvise", "engine": {"cpu_s": 0.5}, "ranks": []}}
    assert ("  host: 3 memory compaction stalls, 0 memory reclaim stalls, 12 huge pages faulted in (transparent huge "
            "pages: always, defrag madvise)") in format_summary(summary).splitlines()


def test_recorded_steps_mark_the_engines_sends_and_takes_and_give_its_methods_back(tiny_llama_dir, monkeypatch):
    from dovetail import LLM, SamplingParams
    from dovetail.bench import step_stats
    from dovetail.engine.step_timeline import StepTimeline

    timelines = []

    class Kept(StepTimeline):
        def stop(self):
            timelines.append(list(self.marks))
            return super().stop()

    monkeypatch.setattr(step_stats, "StepTimeline", Kept)
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, async_scheduling=True)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with step_stats.recorded_steps(engine) as summary:
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
    names = [name for name, _ in timelines[0] if name not in ("collect", "collected")]
    # Three steps launched (the prefill and two decodes), each output taken one step later, then a last take.
    assert names.count("send") == names.count("sent") == 3 and names.count("take") == names.count("taken") == 3
    assert names[:4] == ["schedule", "scheduled", "send", "sent"] and names[-3:] == ["take", "taken", "returned"]
    assert summary["steps"] == 3
    assert not {"execute_model", "take_output"} & set(vars(engine.executor)) and "step" not in vars(engine)


def test_a_timeline_marks_each_garbage_collection_while_it_is_on():
    import gc

    from dovetail.engine.step_timeline import StepTimeline

    timeline = StepTimeline()
    timeline.start()
    gc.collect()
    marks = timeline.stop()
    gc.collect()
    assert [name for name, _ in marks] == ["collect", "collected"] and marks[0][1] <= marks[1][1]
    assert timeline.stop() == []


def test_a_stall_names_the_longest_wait_of_each_process_within_it():
    from dovetail.bench.step_stats import explain_stalls

    # Steps of 9 ms; the step ending at 0.050 took 21 ms, 12 of them with rank 1 waiting for its tokens.
    engine = [("scheduled", 0.010), ("returned", 0.020), ("scheduled", 0.029), ("returned", 0.050)]
    rank0 = [("take", 0.021), ("tokens", 0.028), ("execute", 0.030), ("take", 0.031), ("tokens", 0.049)]
    rank1 = [("take", 0.021), ("tokens", 0.027), ("execute", 0.030), ("launched", 0.036), ("take", 0.036),
             ("tokens", 0.048), ("execute", 0.060)]
    [stall] = longest = [{"step": 4, "sequences": 200, "ms": 21.0, "usual_ms": 9.0, "ended_at": 0.050}]
    explain_stalls(longest, engine, [rank0, rank1])
    assert stall["waits"] == {"engine": ("scheduled", "returned", 21.0), "rank 0": ("take", "tokens", 18.0),
                              "rank 1": ("take", "tokens", 12.0)}
    # Every mark inside the stall, in ms from its start (0.029).
    assert stall["marks"]["engine"] == [("scheduled", 0.0), ("returned", 21.0)]
    assert stall["marks"]["rank 1"] == [("execute", 1.0), ("launched", 7.0), ("take", 7.0), ("tokens", 19.0)]


def test_a_rank_notes_each_point_of_its_steps_only_while_its_timeline_is_on(tiny_llama_dir):
    from dovetail import LLM, SamplingParams

    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, async_scheduling=True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    executor = llm.llm_engine.executor
    executor.collective_rpc("start_timeline")
    llm.generate([[1, 2, 3], [4, 5]], params, use_tqdm=False)
    [marks] = executor.collective_rpc("stop_timeline")
    llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert executor.collective_rpc("stop_timeline") == [[]]
    marks = [(name, t) for name, t in marks if name not in ("collect", "collected")]  # the collections, if any
    names = [name for name, _ in marks]
    times = [t for _, t in marks]
    assert times == sorted(times)
    # Four steps (one prefill, three decodes), each launched, then its tokens taken, one step behind.
    assert names.count("execute") == names.count("launched") == 4 and names.count("tokens") == 4
    assert names[:4] == ["execute", "launched", "execute", "launched"] and names[4:6] == ["take", "tokens"]


def test_throughput_with_a_text_prompt_reports_the_time_to_queue(tmp_path):
    from dovetail.llm import default_model

    out = tmp_path / "enqueue.json"
    rc = main(["--log-level", "WARNING", "bench", "throughput", "--model", default_model(), "--num-prompts", "40",
               "--output-len", "1", "--prompt", "12+34=", "--output-json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["prompt"] == "12+34=" and result["num_requests"] == 40
    dovetail = result["dovetail"]
    assert dovetail["output_tokens"] == 40
    assert dovetail["prompt_tokens"] == 40 * 7, "<s> and the six characters of each prompt"
    assert 0 < dovetail["enqueue_seconds"] < dovetail["seconds"]


def test_latency_reports_decode_time_per_token(tiny_llama_dir, tmp_path, monkeypatch):
    from dovetail.engine import frozen_heap
    from dovetail.engine.llm_engine import LLMEngine

    frozen, step = [], LLMEngine.step
    monkeypatch.setattr(LLMEngine, "step", lambda self: frozen.append(frozen_heap.is_frozen()) or step(self))
    out = tmp_path / "latency.json"
    rc = main(["--log-level", "WARNING", "bench", "latency", "--model", str(tiny_llama_dir), "--device", "cpu",
               "--input-len", "12", "--output-len", "6", "--repeats", "2", "--output-json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())["dovetail"]
    assert result["ms_per_token"] > 0 and len(result["ms_per_token_runs"]) == 2
    assert frozen[-12:] == [True] * 12, "the timed steps run with the heap frozen, as LLM.generate's do"
    assert not frozen_heap.is_frozen()


def test_latency_of_a_batch_decodes_its_requests_together(tiny_llama_dir, tmp_path, monkeypatch):
    """``--batch-size 3``: every timed step decodes the three requests at once; a batch below one is refused."""
    from dovetail.engine.llm_engine import LLMEngine

    batches, step = [], LLMEngine.step
    monkeypatch.setattr(LLMEngine, "step", lambda self: batches.append(len(self.scheduler.running)) or step(self))
    out = tmp_path / "latency.json"
    rc = main(["--log-level", "WARNING", "bench", "latency", "--model", str(tiny_llama_dir), "--device", "cpu",
               "--input-len", "12", "--output-len", "6", "--repeats", "1", "--batch-size", "3",
               "--output-json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["batch_size"] == 3 and result["dovetail"]["ms_per_token"] > 0
    assert result["dovetail"]["all_reduce"] is None, "one rank sums nothing"
    assert batches[-6:] == [0] + [3] * 5, "the timed run's first step admits its requests, each step after holds 3"
    with pytest.raises(SystemExit, match="--batch-size: must be at least 1"):
        main(["bench", "latency", "--model", str(tiny_llama_dir), "--device", "cpu", "--batch-size", "0"])


def test_moe_shapes_are_qwen3_30b_a3b_and_its_first_half():
    """qwen3-30b-a3b has Qwen3-30B-A3B's 30.5B parameters (3.3B active per token); qwen3-moe-15b-a3b its layer
    shape with 24 of the 48 layers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from dovetail.bench.shapes import SHAPES, materialize

    def billions(name):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(SHAPES[name].config())
        return sum(p.numel() for p in model.parameters()) / 1e9

    full, half = billions("qwen3-30b-a3b"), billions("qwen3-moe-15b-a3b")
    assert 30.4 < full < 30.6
    embeddings = 2 * 151936 * 2048 / 1e9
    assert abs((half - embeddings) * 2 - (full - embeddings)) < 1e-5  # the layers, less one final norm
    path, defaults = materialize("qwen3-moe-15b-a3b")
    config = AutoConfig.from_pretrained(path)
    shutil.rmtree(path)
    assert config.architectures == ["Qwen3MoeForCausalLM"] and defaults["load_format"] == "dummy"
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (128, 8, 768)


def test_throughput_with_structured_output_reports_both_runs_and_the_compile_time(tiny_llama_dir, tmp_path):
    out = tmp_path / "structured.json"
    rc = main(["--log-level", "WARNING", "bench", "throughput", "--model", str(tiny_llama_dir), "--device", "cpu",
               "--num-prompts", "3", "--input-len", "8:12", "--output-len", "6:9", "--structured-output", "json",
               "--output-json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    constrained = result["structured_output"]
    assert constrained["output_tokens"] > 0 and constrained["grammar_compile_seconds"] > 0
    assert constrained["ratio_to_full_run"] == (constrained["output_tokens_per_s"]
                                                / result["dovetail"]["output_tokens_per_s"])
    assert constrained["ratio_to_unconstrained"] == (constrained["output_tokens_per_s"]
                                                     / constrained["unconstrained_same_lengths"]["output_tokens_per_s"])


def test_a_named_shape_gets_a_synthetic_tokenizer_that_xgrammar_reads(tmp_path):
    import xgrammar as xgr

    from dovetail.bench.shapes import synthetic_tokenizer

    tokenizer = synthetic_tokenizer(tmp_path, 3000)
    assert len(tokenizer) == 3000 and tokenizer.eos_token_id == 2999
    text = '{"name": "Ada", "tags": [1, 2]}'
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text and len(ids) < len(text)  # merges join characters into tokens
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=3000)
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL and info.stop_token_ids == [2999]


def test_startup_reports_the_phases_of_a_fresh_process(tiny_llama_dir):
    """``benchmarks/startup.py``: a fresh interpreter to its first token, split into the interpreter, the imports,
    the engine's own phases (the worker's within them) and the first token."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "startup.py"
    done = subprocess.run([sys.executable, str(script), "--model", str(tiny_llama_dir), "--device", "cpu"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert list(report["engine_phases"]) == ["config_s", "workers_and_weights_s", "memory_profile_s",
                                             "kv_cache_and_graphs_s"]
    assert list(report["worker_phases"]) == ["device_and_group_s", "model_config_s", "model_build_s", "weights_s",
                                             "runner_s"], "one rank in this process: no process start, no all-reduce"
    parts = report["interpreter_s"] + report["imports_s"] + report["engine_s"] + report["first_token_s"]
    assert 0 < parts <= report["startup_to_first_token_s"] + 1e-6
    assert sum(report["engine_phases"].values()) <= report["engine_s"] + 0.01
    assert sum(report["worker_phases"].values()) <= report["engine_phases"]["workers_and_weights_s"] + 0.02


def _kernels_linear():
    from repo_scripts import load_script

    return load_script("benchmarks/kernels_linear.py")


def test_the_linear_benchmark_takes_one_ranks_share_of_each_product():
    """``benchmarks/kernels_linear.py --tp 2``: column-parallel products lose half their output features,
    row-parallel ones half their input features, the router none."""
    from dovetail.bench import shapes

    kernels_linear = _kernels_linear()
    whole = shapes.projections(shapes.SHAPES["llama-3.1-8b"].config())
    shares = {name: kernels_linear.rank_share(name, n, k, 2) for name, (n, k) in whole.items()}
    assert shares == {"qkv": (3072, 4096), "o": (4096, 2048), "gate_up": (14336, 4096), "down": (4096, 7168),
                      "lm_head": (64128, 4096)}
    assert kernels_linear.rank_share("router", 128, 2048, 2) == (128, 2048)


def test_the_linear_benchmarks_sustained_rate_counts_only_the_second_half(monkeypatch):
    """``kernels_linear.py --sustain``: rounds of the first half (before the card reaches its power cap) are left
    out; the rate is the FLOPs of the later rounds over the time between their ends."""
    kernels_linear = _kernels_linear()
    clock = [0.0]
    monkeypatch.setattr(kernels_linear.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(kernels_linear.torch.cuda, "synchronize", lambda: None)
    round_seconds = iter([0.3] * 2 + [0.1] * 100)  # two slow rounds while the card warms, then fast ones

    def product(_):
        clock[0] += next(round_seconds)

    rate = kernels_linear.sustained_tflops([product], flop=10**12, seconds=2.0)
    assert rate == pytest.approx(10.0), "1e12 FLOPs a 0.1 s round: the 0.3 s rounds would lower it"
