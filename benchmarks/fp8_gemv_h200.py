"""The weight-only FP8 GEMV (``dovetail.triton.gemv``) against cuBLAS bf16 and ``torch._scaled_mm``, issue 9.

For llama-3.1-8b's linear shapes (N, K) and M in {1, 2, 4, 8, 16} tokens, on one GPU (the H200):

1. checks ``fp8_gemv`` (every config below) against the float reference ``x.float() @ (w.float() * s).T``
   (max error relative to max |reference|);
2. times, from CUDA graphs (how the engine runs decode), cuBLAS bf16 ``F.linear``, the W8A8 path
   ``fp8_linear_scaled_mm`` (per-token activation quantization + ``torch._scaled_mm``), ``fp8_gemv``
   with ``default_config`` and over a grid of configs. Each graph runs ``CALLS`` products that cycle over
   enough copies of the weight (at least 256 MB of them) that no product reads its weight from the 60 MB
   L2; a time is the median over ``REPLAYS`` replays of the graph's CUDA-event time divided by ``CALLS``.

Prints one table per shape (µs per product; GB/s of weight bytes read) and the best config per shape and
M, then the sum over one decode step's linears (32 layers of qkv, o, gate_up, down; lm_head is bf16 in
the engine and listed apart). Everything goes to ``$OUT/fp8_gemv.json`` (OUT defaults to /tmp/out).
A config that fails to compile or run is reported and skipped. About a minute on an H200 (53 s seen).

Usage: ``python3 benchmarks/fp8_gemv_h200.py [--shapes qkv,o] [--ms 1,4]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))

from dovetail.quantization import quant_ops  # noqa: E402
from dovetail.quantization.fp8_scaled_mm import fp8_linear_scaled_mm  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
LAYERS = 32
MS = (1, 2, 4, 8, 16)
CALLS = 16
REPLAYS = 10
COPY_BYTES = 256 << 20
#: (block_n, block_k, num_warps, num_stages, split_k, dot). Register-sum configs (dot False) only up to M=4,
#: their block_k divided by the rows padded to a power of two (their accumulator is M x BLOCK_N x BLOCK_K).
GRID = [(bn, bk, 4, stages, split, True) for bn in (16, 32, 64) for bk in (128, 256, 512) for stages in (3, 5)
        for split in (1, 2, 4, 8) if bn * bk <= 16384] + [
    (16, 512, 4, 1, 1, False), (16, 512, 4, 1, 2, False), (16, 512, 4, 1, 4, False), (16, 1024, 8, 1, 1, False),
    (16, 1024, 8, 1, 4, False), (32, 256, 4, 1, 1, False), (32, 256, 4, 1, 4, False), (8, 512, 4, 1, 2, False),
]


def grid_for(m: int, config_cls) -> list:
    """The configs of ``GRID`` that apply to ``m`` rows."""
    rows = 1 << max(0, m - 1).bit_length()
    out = []
    for bn, bk, warps, stages, split, dot in GRID:
        if not dot and m > 4:
            continue
        out.append(config_cls(bn, bk if dot else max(64, bk // rows), warps, stages, split, dot))
    return out


def time_graph(fn, calls: int) -> float:
    """Median µs per call of ``fn(i)`` for i in range(calls), captured in one CUDA graph and replayed."""
    for i in range(calls):  # compile, autotune and allocate outside the capture
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    del graph
    return statistics.median(times)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max())


def bench_shape(name: str, n: int, k: int, ms: list[int], fp8_gemv, default_config, config_cls) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    w[:, :7] *= 30  # outlier columns, as real checkpoints have
    q, scale = quant_ops.quantize_fp8_per_channel(w)
    copies_fp8 = max(1, -(-COPY_BYTES // (n * k)))
    copies_bf16 = max(1, -(-COPY_BYTES // (2 * n * k)))
    qs = [q] + [q.clone() for _ in range(copies_fp8 - 1)]
    ws = [w.bfloat16() for _ in range(copies_bf16)]
    del w
    x_all = torch.randn(max(ms), k, device="cuda", generator=gen).bfloat16()
    ref_all = x_all.float() @ (q.float() * scale[:, None]).t()
    result = {"n": n, "k": k, "copies_fp8": copies_fp8, "copies_bf16": copies_bf16, "m": {}}
    for m in ms:
        x, ref = x_all[:m].contiguous(), ref_all[:m]
        row = {"default_config": list(default_config(m, n, k))}
        row["rel_err_default"] = rel_err(fp8_gemv(x, q, scale), ref)
        row["rel_err_scaled_mm"] = rel_err(fp8_linear_scaled_mm(x, q, scale), ref)
        row["bf16_us"] = time_graph(lambda i: F.linear(x, ws[i % copies_bf16]), CALLS)
        row["scaled_mm_us"] = time_graph(lambda i: fp8_linear_scaled_mm(x, qs[i % copies_fp8], scale), CALLS)
        row["gemv_default_us"] = time_graph(lambda i: fp8_gemv(x, qs[i % copies_fp8], scale), CALLS)
        configs, failed = [], []
        for cfg in grid_for(m, config_cls):
            try:
                err = rel_err(fp8_gemv(x, q, scale, config=cfg), ref)
                us = time_graph(lambda i, cfg=cfg: fp8_gemv(x, qs[i % copies_fp8], scale, config=cfg), CALLS)
                configs.append({"config": list(cfg), "us": us, "rel_err": err})
            except Exception as exc:  # a config that does not compile or launch: report, go on
                failed.append({"config": list(cfg), "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                torch.cuda.synchronize()
        ok = [c for c in configs if c["rel_err"] < 1e-2]
        row["configs"], row["failed"] = configs, failed
        row["best"] = min(ok, key=lambda c: c["us"]) if ok else None
        result["m"][m] = row
        best = row["best"]
        gbs = lambda us, nbytes: nbytes / us / 1e3  # noqa: E731
        print(f"{name:>8} M={m:<3} bf16 {row['bf16_us']:7.1f}us {gbs(row['bf16_us'], 2 * n * k):6.0f}GB/s | "
              f"scaled_mm {row['scaled_mm_us']:7.1f}us | gemv default {row['gemv_default_us']:7.1f}us "
              f"{gbs(row['gemv_default_us'], n * k):6.0f}GB/s err {row['rel_err_default']:.1e} | best "
              + (f"{best['us']:7.1f}us {gbs(best['us'], n * k):6.0f}GB/s {tuple(best['config'])}" if best else "none")
              + (f" | {len(failed)} failed" if failed else ""), flush=True)
    return result


def summary(results: dict) -> dict:
    """µs per decode step summed over 32 layers' qkv, o, gate_up and down (lm_head apart), per M and path."""
    out = {}
    layer = [s for s in ("qkv", "o", "gate_up", "down") if s in results]
    if len(layer) < 4:
        return out
    for m in results[layer[0]]["m"]:
        paths = {}
        for key in ("bf16_us", "scaled_mm_us", "gemv_default_us"):
            paths[key] = LAYERS * sum(results[s]["m"][m][key] for s in layer)
        bests = [results[s]["m"][m]["best"] for s in layer]
        if all(bests):
            paths["gemv_best_us"] = LAYERS * sum(b["us"] for b in bests)
        if "lm_head" in results:
            paths["lm_head_bf16_us"] = results["lm_head"]["m"][m]["bf16_us"]
        out[m] = paths
        print(f"decode step linears M={m:<3} " + "  ".join(f"{k[:-3]} {v / 1000:.3f}ms" for k, v in paths.items()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of " + ", ".join(SHAPES))
    parser.add_argument("--ms", default=",".join(map(str, MS)), help="comma-separated token counts")
    args = parser.parse_args()
    from dovetail.triton.gemv import GemvConfig, default_config, fp8_gemv

    out_dir = Path(os.environ.get("OUT", "/tmp/out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    import triton

    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}; "
          f"CUDA-graph timing, {CALLS} products per graph over >= {COPY_BYTES >> 20} MB of weight copies")
    ms = [int(v) for v in args.ms.split(",")]
    started = time.time()
    results = {}
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        results[name] = bench_shape(name, n, k, ms, fp8_gemv, default_config, GemvConfig)
        torch.cuda.empty_cache()
    report = {"device": props.name, "torch": torch.__version__, "triton": triton.__version__,
              "timing": f"CUDA graph of {CALLS} products, median of {REPLAYS} replays",
              "config_fields": list(GemvConfig._fields), "shapes": results, "decode_step": summary(results),
              "seconds": round(time.time() - started, 1)}
    print("\nbest config per shape and M (block_n, block_k, num_warps, num_stages, split_k, dot):")
    for name, res in results.items():
        for m, row in res["m"].items():
            best = row["best"]
            print(f"  {name:>8} M={m:<3} default {tuple(row['default_config'])} {row['gemv_default_us']:.1f}us; best "
                  + (f"{tuple(best['config'])} {best['us']:.1f}us" if best else "none"))
    (out_dir / "fp8_gemv.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out_dir / 'fp8_gemv.json'} ({report['seconds']}s)")


if __name__ == "__main__":
    main()
