"""bf16 matrix products at every decode batch size: how long llama-3.1-8b's linears take at M = 1..256
tokens (and at prefill sizes) under cuBLASLt and cuBLAS, against the roofline.

    python3 benchmarks/h200_gemm_sweep.py [--max-m 256] [--prefill 4096 8192 16384]

Each figure is the median time of one ``F.linear`` call inside a CUDA graph of many calls, rotating
through enough weight copies (at least 256 MiB) that no weight stays in L2, as in a decode step where
every layer's weights come from HBM. Writes ``$OUT/gemm_sweep.json``: ``{library: {shape: {M: us}}}``,
and prints, for B1's decode steps (BENCHMARKS.md's workload, every step padded to the engine's graph
batch sizes), the summed time of each library, of the faster library per M, and of the best padding.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from h200_profile_decode import LLAMA_8B_SHAPES as LLAMA_8B, time_linear  # benchmarks/, this script's directory

LAYERS = 32


def b1_decode_batches(num: int = 256, seed: int = 0) -> list[int]:
    """Rows of every decode step of B1 once all prompts are in: the requests still running at each step."""
    from dovetail.bench.workload import random_requests

    outputs = [r.output_len for r in random_requests(num, (100, 1024), (100, 1024), LLAMA_8B["lm_head"][0], seed)]
    return [r for r in (sum(1 for o in outputs if o > t) for t in range(1, max(outputs))) if r]


def graph_size(m: int) -> int:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16))
    return next(s for s in sizes if s >= m)


def print_b1_decode(results: dict, libraries: list[str], max_m: int) -> None:
    """B1's decode GEMM seconds by library, by the faster library per M, and with the best padding."""

    def step_us(library: str, m: int) -> float:
        return sum(results[library][s][m] * (1 if s == "lm_head" else LAYERS) for s in LLAMA_8B)

    steps = b1_decode_batches()
    for library in libraries:
        total = sum(step_us(library, graph_size(m)) for m in steps) / 1e6
        print(f"B1 decode GEMMs, {library}, graph sizes every 16: {total:.3f} s")
    best = {m: min(step_us(lib, m) for lib in libraries) for m in range(1, max_m + 1)}
    print(f"faster library per M, every 16: {sum(best[graph_size(m)] for m in steps) / 1e6:.3f} s")
    print(f"faster library per M, no padding: {sum(best[m] for m in steps) / 1e6:.3f} s")
    print(f"faster library, best padding: {sum(min(best[s] for s in range(m, max_m + 1)) for m in steps) / 1e6:.3f} s")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--max-m", type=int, default=256)
    p.add_argument("--prefill", type=int, nargs="*", default=[4096, 8192, 16384])
    p.add_argument("--libraries", nargs="*", default=["cublaslt", "cublas"])
    args = p.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    ms = list(range(1, args.max_m + 1)) + args.prefill
    results: dict = {}
    for name, (n, k) in LLAMA_8B.items():
        copies = max(2, -(-256 * 2**20 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for library in args.libraries:
            torch.backends.cuda.preferred_blas_library(library)
            results.setdefault(library, {})[name] = {
                m: time_linear(F.linear, torch.randn(m, k, device="cuda", dtype=torch.bfloat16), weights) for m in ms}
            print(library, name, {m: round(results[library][name][m], 1) for m in (1, 16, 64, 128, 256) if m <= args.max_m},
                  flush=True)
        del weights
        torch.cuda.empty_cache()
    (out / "gemm_sweep.json").write_text(json.dumps(results))

    if args.max_m >= 256:
        print_b1_decode(results, args.libraries, args.max_m)
    else:
        print("B1's decode steps need --max-m 256 or more: not summed")
    for m in args.prefill:
        flops = 2 * m * sum(n * k * (1 if s == "lm_head" else LAYERS) for s, (n, k) in LLAMA_8B.items() if s != "lm_head")
        for library in args.libraries:
            us = sum(results[library][s][m] * LAYERS for s in LLAMA_8B if s != "lm_head")
            print(f"prefill M={m} {library}: layers {us / 1e3:.2f} ms, {flops / us / 1e6:.0f} TFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
