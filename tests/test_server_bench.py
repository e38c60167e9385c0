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
