"""torch.profiler on every rank: ``DOVETAIL_TORCH_PROFILER_DIR``, ``LLM.start_profile/stop_profile`` and the
server's ``/start_profile`` and ``/stop_profile``."""

from __future__ import annotations

import gzip
import json

import httpx
import pytest

from dovetail import LLM, SamplingParams
from dovetail.errors import ConfigError
from test_server_cli import ServerProcess, auth

COMMON = dict(device="cpu", attention_backend="REFERENCE", dtype="float32", max_model_len=128)
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _profiled_ops(summary_path: str) -> str:
    text = open(summary_path).read()
    assert "Name" in text and "Self CPU" in text
    return text


def _profile_step():
    from repo_scripts import load_script

    return load_script("benchmarks/profile_step.py")


def _trace_events(directory, rank: int) -> list:
    (trace,) = directory.glob(f"rank{rank}.*.pt.trace.json.gz")
    with gzip.open(trace, "rt") as f:
        return json.load(f)["traceEvents"]


@pytest.mark.parametrize("tp", [1, 2], ids=["one-rank", "two-ranks"])
def test_each_rank_writes_a_trace_and_a_summary_of_its_steps(tiny_llama_dir, tmp_path, monkeypatch, tp):
    monkeypatch.setenv("DOVETAIL_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=tp, **COMMON)
    try:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], PARAMS, use_tqdm=False)  # not profiled
        llm.start_profile()
        with pytest.raises(ConfigError, match="already running"):
            llm.start_profile()
        llm.generate([{"prompt_token_ids": [8, 9, 10, 11]}], PARAMS, use_tqdm=False)
        summaries = llm.stop_profile()
        with pytest.raises(ConfigError, match="not running"):
            llm.stop_profile()
    finally:
        llm.llm_engine.shutdown()
    assert [s.rsplit("/", 1)[-1] for s in summaries] == [f"rank{r}_summary.txt" for r in range(tp)]
    for rank, summary in enumerate(summaries):
        assert "aten::" in _profiled_ops(summary)  # the model's operators ran under the profiler
        names = {event.get("name", "") for event in _trace_events(tmp_path / "traces", rank)}
        assert any(name.startswith("aten::") for name in names)
        if tp == 2:
            assert any("allreduce" in name for name in names), f"rank {rank}'s collectives are in its trace"


def test_profiling_needs_the_directory(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv("DOVETAIL_TORCH_PROFILER_DIR", raising=False)
    llm = LLM(str(tiny_llama_dir), **COMMON)
    with pytest.raises(ConfigError, match="DOVETAIL_TORCH_PROFILER_DIR"):
        llm.start_profile()


def test_the_server_profiles_between_requests_when_the_directory_is_set(tiny_llama_dir, tmp_path):
    server = ServerProcess(tiny_llama_dir, "--served-model-name", "tiny",
                           env={"DOVETAIL_TORCH_PROFILER_DIR": str(tmp_path)})
    try:
        assert httpx.post(server.url("/start_profile"), timeout=60).status_code == 200
        again = httpx.post(server.url("/start_profile"), timeout=60)
        assert again.status_code == 400 and "already running" in again.json()["error"]["message"]
        done = httpx.post(server.url("/v1/completions"), timeout=60, json={
            "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})
        assert done.status_code == 200
        stopped = httpx.post(server.url("/stop_profile"), timeout=120)
        assert stopped.status_code == 200
        (summary,) = stopped.json()["summaries"]
        assert "aten::" in _profiled_ops(summary)
    finally:
        server.stop()
    plain = ServerProcess(tiny_llama_dir, env={"DOVETAIL_TORCH_PROFILER_DIR": ""})
    try:
        assert httpx.post(plain.url("/start_profile"), headers=auth(), timeout=30).status_code == 404
    finally:
        plain.stop()


def test_bench_profiles_its_timed_run(tiny_llama_dir, tmp_path, monkeypatch):
    from dovetail.cli.main import main

    out = tmp_path / "latency.json"
    monkeypatch.delenv("DOVETAIL_TORCH_PROFILER_DIR", raising=False)
    args = ["--log-level", "WARNING", "bench", "latency", "--model", str(tiny_llama_dir), "--device", "cpu",
            "--input-len", "8", "--output-len", "4", "--repeats", "1", "--profile", "--output-json", str(out)]
    assert main(args) != 0 and not out.exists(), "--profile without the directory is refused before the run"
    monkeypatch.setenv("DOVETAIL_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    assert main(args) == 0
    (summary,) = json.loads(out.read_text())["dovetail"]["profile_summaries"]
    assert "aten::" in _profiled_ops(summary)


def test_the_trace_summary_adds_busy_time_once_and_classes_the_idle_gaps(tmp_path):
    """``benchmarks/profile_step.py --trace``: overlapping kernels (programmatic dependent launch) count once
    towards the busy time, each gap counts in its length class and a short one towards the kernels on either
    side of it, host events are left out of the device's time, and the longest gaps name the host's calls then."""
    profile_step = _profile_step()

    def kernel(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    events = [kernel("_paged_attention_kernel", 0, 100), kernel("_rms_norm_kernel", 90, 20),  # overlap of 10
              kernel("nvjet_gemm", 113, 50),  # a 3 µs gap
              kernel("_paged_attention_kernel", 1663, 40),  # a 1,500 µs gap
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 170, "dur": 1400},
              {"ph": "X", "cat": "user_annotation", "name": "the whole step", "ts": 0, "dur": 20000}]
    path = tmp_path / "rank0.1.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = profile_step.trace_summary(str(path))
    assert summary["span_s"] == pytest.approx(1703e-6)
    assert summary["busy_s"] == pytest.approx(200e-6), "100 + 10 past the overlap + 50 + 40"
    assert summary["kernel_s"] == pytest.approx(210e-6)
    assert summary["idle_s_by_gap_us"]["<5"] == pytest.approx(3e-6)
    assert summary["idle_s_by_gap_us"]["<inf"] == pytest.approx(1500e-6)
    assert summary["kernels"][0] == {"name": "_paged_attention_kernel", "s": pytest.approx(140e-6), "calls": 2}
    assert summary["groups_s"]["attention"] == pytest.approx(140e-6)
    assert summary["groups_s"]["matmul"] == pytest.approx(50e-6)
    assert summary["short_idle_between"] == [
        {"after": "_rms_norm_kernel", "before": "nvjet_gemm", "s": pytest.approx(3e-6)}], \
        "the short gap is the norm's (which ended last), before the GEMM; the long one is not counted"
    (gap,) = summary["longest_gaps"]
    assert (gap["us"], gap["at_s"], gap["after"], gap["before"]) == (1500, pytest.approx(163e-6), "nvjet_gemm",
                                                                     "_paged_attention_kernel")
    assert gap["host"] == ["aten::mm 1500us", "cudaStreamSynchronize 1400us"], \
        "the host's calls by their time within the gap, the one spanning far more than the gap left out"
    assert summary["between_graphs"] is None, "no graph replays in this trace"
    assert summary["outside_graphs_groups_s"] == pytest.approx(summary["groups_s"]), \
        "without replays every kernel is eager"


def test_the_trace_summary_times_what_runs_between_graph_replays(tmp_path):
    """The interval from one replay's last kernel to the next replay's first, and the copies and kernels the
    step's inputs take in it, found by the replays' launch correlation ids."""
    profile_step = _profile_step()

    def op(name, ts, dur, correlation, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}

    def launch(correlation, ts):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "dur": 5,
                "args": {"correlation": correlation}}

    events = [launch(1, 0), op("gemm", 10, 50, 1), op("norm", 60, 10, 1),  # replay 1 ends at 70
              op("Memcpy HtoD", 80, 2, 7, "gpu_memcpy"), op("index_select", 90, 2, 8),
              launch(2, 20), op("gemm", 100, 50, 2), op("norm", 155, 5, 2),  # 30 µs after replay 1, 2 ops
              op("Memcpy HtoD", 170, 2, 9, "gpu_memcpy"), launch(3, 160), op("gemm", 220, 30, 3)]  # 60 µs, 1 op
    path = tmp_path / "rank0.1.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = profile_step.trace_summary(str(path))
    between = summary["between_graphs"]
    assert between == {"intervals": 2, "median_us": 45.0, "total_s": pytest.approx(90e-6), "median_ops": 1.5}
    assert summary["groups_s"]["matmul"] == pytest.approx(130e-6)
    assert summary["outside_graphs_groups_s"] == {"other": pytest.approx(6e-6)}, \
        "the eager steps' groups hold only the copies and the gather, none of the replays' kernels"


def test_the_prefill_profiles_rate_counts_the_layers_products_flops(tmp_path):
    """``profile_step.py --b1 N --prefill-only``: the FLOPs its TFLOP/s divides are, per prompt token, 2 x the
    layers' qkv, o, gate/up and down weights (GQA's narrower k and v counted as such, the LM head left out)."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96, vocab_size=1000).save_pretrained(tmp_path)
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 2 * 96 * 64 + 96 * 64
    assert _profile_step().layer_product_flops_per_token(str(tmp_path)) == 2 * 3 * per_layer


def test_the_prefill_profiles_rate_refuses_a_mixture_of_experts(tmp_path):
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2).save_pretrained(tmp_path)
    with pytest.raises(SystemExit, match="counts a dense model's products; .* routes to experts"):
        _profile_step().layer_product_flops_per_token(str(tmp_path))


def test_prefill_only_needs_b1_and_no_stages(monkeypatch, capsys):
    profile_step = _profile_step()
    for argv in (["--prefill-only"], ["--b1", "4", "--stages", "--prefill-only"]):
        monkeypatch.setattr("sys.argv", ["profile_step.py", *argv])
        with pytest.raises(SystemExit) as exit_info:
            profile_step.main()
        assert exit_info.value.code == 2
        assert "--prefill-only profiles B1's prefill steps" in capsys.readouterr().err
