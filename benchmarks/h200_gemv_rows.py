"""The Triton GEMV's tensor-core path against cuBLAS for a few to 128 rows, on llama-3.1-8b's linears.

B1's last few hundred decode steps run 1-128 sequences, where a linear is bound by reading its weight:
cuBLAS read them at 2.4-4.1 TB/s there (``h200_gemm_sweep.py``, eleventh session) against about 4.6 TB/s a
read-only kernel reaches (``h200_attention_layers.py``). This times ``F.linear`` and ``dovetail.triton.gemv``
with one block of rows (``block_m``: the rows rounded up to a power of two, 16 to 128) over a grid of tile
configurations, each weight read from memory (copies in rotation, more than L2 holds), and prints per row
count the fastest configuration per shape and the layer's four linears summed. JSON in ``$OUT/gemv_rows.json``.

    python3 benchmarks/h200_gemv_rows.py [--rows 8,16,32,48,64,96,128]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from h200_profile_decode import LLAMA_8B_SHAPES, time_linear

from dovetail.triton import next_power_of_2
from dovetail.triton.gemv import GemvConfig, gemv, split_k_for


def configs(m: int, n: int, k: int) -> list[GemvConfig]:
    block_m = min(128, max(16, next_power_of_2(m)))
    grid = []
    for block_n, block_k, stages, warps in itertools.product((64, 128), (128, 256), (3, 4), (4, 8)):
        if warps == 8 and block_n == 64:
            continue
        grid.append(GemvConfig(block_n, block_k, warps, stages, split_k_for(n, k, block_n, block_k), True,
                               block_m=block_m))
    return grid


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="8,16,32,48,64,96,128")
    args = parser.parse_args()
    results = []
    for name, (n, k) in LLAMA_8B_SHAPES.items():
        copies = max(2, (256 * 1024**2) // (n * k * 2) + 1)
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = torch.nn.functional.linear(x, weights[0]).float()
            row = {"shape": name, "m": m, "cublas_us": time_linear(torch.nn.functional.linear, x, weights,
                                                                   iters=copies * 4), "triton": []}
            for cfg in configs(m, n, k):
                try:
                    error = (gemv(x, weights[0], config=cfg).float() - want).abs().max().item()
                    us = time_linear(lambda a, w, cfg=cfg: gemv(a, w, config=cfg), x, weights, iters=copies * 4)
                except Exception as exc:  # shared memory or registers
                    print(f"  {name} m={m} {cfg}: {type(exc).__name__}", flush=True)
                    continue
                row["triton"].append({"config": cfg._asdict(), "us": us, "max_abs_err": error})
            best = min(row["triton"], key=lambda t: t["us"])
            row["best"] = best
            print(f"{name:8} m={m:4} cublas {row['cublas_us']:7.1f} us ({n * k * 2 / row['cublas_us'] / 1e6:4.2f} TB/s)"
                  f"  triton {best['us']:7.1f} us ({n * k * 2 / best['us'] / 1e6:4.2f} TB/s, err {best['max_abs_err']:.1e})"
                  f"  {best['config']}", flush=True)
            results.append(row)
        del weights
        torch.cuda.empty_cache()
    for m in sorted({r["m"] for r in results}):
        layer = [r for r in results if r["m"] == m and r["shape"] != "lm_head"]
        cublas = sum(r["cublas_us"] for r in layer)
        triton_best = sum(min(r["cublas_us"], r["best"]["us"]) for r in layer)
        print(f"layer m={m:4}: cublas {cublas:7.1f} us, with the triton GEMV where faster {triton_best:7.1f} us "
              f"({triton_best / cublas - 1:+.1%})", flush=True)
    out = os.path.join(os.environ.get("OUT", "/tmp/out"), "gemv_rows.json")
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
