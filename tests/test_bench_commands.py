"""``dovetail bench throughput`` and ``bench latency`` end to end on the CPU, on a tiny model directory."""

from __future__ import annotations

import json

from dovetail.bench.workload import greedy_inputs, random_requests
from dovetail.cli.main import main


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


def test_latency_reports_decode_time_per_token(tiny_llama_dir, tmp_path):
    out = tmp_path / "latency.json"
    rc = main(["--log-level", "WARNING", "bench", "latency", "--model", str(tiny_llama_dir), "--device", "cpu",
               "--input-len", "12", "--output-len", "6", "--repeats", "2", "--output-json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())["dovetail"]
    assert result["ms_per_token"] > 0 and len(result["ms_per_token_runs"]) == 2


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
    assert config.architectures == ["Qwen3MoeForCausalLM"] and defaults["load_format"] == "dummy"
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (128, 8, 768)
