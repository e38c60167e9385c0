"""``dovetail bench serve`` (B3) against a real server: every request completes and the JSON adds up."""

from __future__ import annotations

import asyncio
import json

import pytest

from dovetail.bench.serve import percentile
from test_server_cli import API_KEY, MAIN_FLAGS, shared_server


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    return shared_server(tiny_llama_dir, *MAIN_FLAGS)


def test_percentile_interpolates_like_numpy():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)
    assert percentile([7.0], 99) == 7.0


def test_bench_serve_reports_every_rate(server, tmp_path):
    from dovetail.bench.serve import benchmark
    from dovetail.cli.main import build_parser

    out = tmp_path / "b3.json"
    args = build_parser().parse_args([
        "bench", "serve", "--base-url", server.base_url, "--api-key", API_KEY, "--model", "tiny-alias",
        "--rates", "50", "inf", "--num-prompts", "6", "--input-len", "4:20", "--output-len", "3:9",
        "--output-json", str(out)])
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert result["model"] == "tiny-alias" and [r["rate"] for r in result["results"]] == [50.0, "inf"]
    for rate in result["results"]:
        assert rate["completed"] == 6 and rate["failed"] == 0
        # Output lengths are drawn in [3, 9] and every request ignores EOS.
        assert 18 <= rate["output_tokens"] <= 54
        assert rate["output_tokens_per_s"] == pytest.approx(rate["output_tokens"] / rate["duration_s"])
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            assert 0 < rate[key]["p50"] <= rate[key]["p99"]
    # The same seed gives the same request set, so both rates generate the same number of tokens.
    assert result["results"][0]["output_tokens"] == result["results"][1]["output_tokens"]

    args.rates = ["0"]
    with pytest.raises(SystemExit, match="--rates"):
        asyncio.run(benchmark(args))
    args.rates, args.output_len = ["1"], "3:1000"
    with pytest.raises(SystemExit, match="max_model_len"):
        asyncio.run(benchmark(args))


def test_bench_serve_sends_a_background_request_first_and_reports_it(server, tmp_path):
    out = tmp_path / "background.json"
    fan_out = json.dumps({"prompt": ["hi"] * 3, "n": 200, "max_tokens": 1})  # 600 sequences: over the limit
    args = build_parser_args(server, "--rates", "inf", "--num-prompts", "2", "--input-len", "4", "--output-len", "3",
                             "--background-request", fan_out, "--background-delay", "0.2", "--output-json", str(out))
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert result["results"][0]["completed"] == 2
    background = result["background"]
    assert background["status"] == 400 and background["error"]["param"] == "n"
    assert background["answered_before_the_measured_requests_ended"] is True
    assert background["seconds"] > 0


def build_parser_args(server, *extra):
    from dovetail.cli.main import build_parser

    return build_parser().parse_args(["bench", "serve", "--base-url", server.base_url, "--api-key", API_KEY, *extra])
