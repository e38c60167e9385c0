"""Batch-1 linears on the GPU: cuBLAS against the Triton GEMV (16-bit and FP8 weights), with and without PDL.

For the linear shapes of llama-3.1-8b and qwen3-0.6b at one token, times from CUDA graphs (how the engine
runs decode; each graph runs ``CALLS`` products cycling over enough weight copies that none is read from
L2; median of ``REPLAYS`` replays):

1. per shape: cuBLAS bf16 ``F.linear``; :func:`dovetail.triton.fp8_gemv.gemv` on the bf16 weight over a
   small grid of configs, with programmatic dependent launch (PDL), and its best config without; the FP8
   GEMV's default config with and without PDL;
2. one decode step's layer linears in a single graph (qkv, o, gate_up, down for every layer, back to back),
   by each path: what PDL saves between dependent kernels.

Results (µs per product and GB/s of weight read) go to ``$OUT/gemv_pdl.json``. Checks each Triton result
against the float reference first. Usage: ``python3 benchmarks/gemv_pdl_h200.py [--models llama-3.1-8b]``.
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
from dovetail.triton import fp8_gemv as gemv_module  # noqa: E402
from dovetail.triton.fp8_gemv import Fp8GemvConfig, default_config, fp8_gemv, gemv  # noqa: E402

MODELS = {
    "llama-3.1-8b": {"layers": 32, "shapes": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                                              "down": (4096, 14336)}},
    "qwen3-0.6b": {"layers": 28, "shapes": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024),
                                            "down": (1024, 3072)}},
}
CALLS = 16
REPLAYS = 10
COPY_BYTES = 256 << 20
#: (block_n, block_k, num_warps, num_stages, split_k, dot); split_k None: the default heuristic's split.
GRID = [(64, 128, 4, 5, None, True), (32, 256, 4, 4, None, True), (64, 256, 4, 3, None, True),
        (16, 128, 4, 5, None, True), (32, 128, 4, 5, None, True),
        (16, 512, 4, 1, 1, False), (16, 512, 4, 3, 1, False), (8, 1024, 4, 3, 1, False), (32, 256, 4, 3, 1, False),
        (16, 512, 4, 3, 2, False), (8, 512, 4, 3, 1, False), (16, 256, 4, 3, 1, False)]


def set_pdl(on: bool) -> None:
    gemv_module.use_pdl = lambda device: on


def time_graph(fn, calls: int) -> float:
    """Median µs per call of ``fn(i)`` for i in range(calls), captured in one CUDA graph and replayed."""
    for i in range(calls):
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


def config_for(spec, n, k) -> Fp8GemvConfig:
    bn, bk, warps, stages, split, dot = spec
    if split is None:
        split = default_config(1, n, k).split_k if (bn, bk) == (64, 128) else _split(n, k, bn, bk)
    return Fp8GemvConfig(bn, bk, warps, stages, split, dot)


def _split(n, k, bn, bk) -> int:
    split = 1
    while -(-n // bn) * split < gemv_module.MIN_PROGRAMS and k >= 4 * bk * split:
        split *= 2
    return split


def rel_err(out, ref) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max())


def bench_shape(name, n, k, gen) -> dict:
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    q, scale = quant_ops.quantize_fp8_per_channel(w)
    ws = [w.bfloat16() for _ in range(max(1, -(-COPY_BYTES // (2 * n * k))))]
    qs = [q] + [q.clone() for _ in range(max(1, -(-COPY_BYTES // (n * k))) - 1)]
    del w
    x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
    ref16 = x.float() @ ws[0].float().t()
    ref8 = x.float() @ (q.float() * scale[:, None]).t()
    row = {"n": n, "k": k, "cublas_us": time_graph(lambda i: F.linear(x, ws[i % len(ws)]), CALLS)}
    configs = []
    set_pdl(True)
    for spec in GRID:
        cfg = config_for(spec, n, k)
        try:
            err = rel_err(gemv(x, ws[0], config=cfg), ref16)
            us = time_graph(lambda i, cfg=cfg: gemv(x, ws[i % len(ws)], config=cfg), CALLS)
            configs.append({"config": list(cfg), "us": us, "rel_err": err})
        except Exception as exc:
            configs.append({"config": list(cfg), "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            torch.cuda.synchronize()
    ok = [c for c in configs if c.get("rel_err", 1) < 1e-2]
    row["bf16_configs"] = configs
    row["bf16_best"] = best = min(ok, key=lambda c: c["us"]) if ok else None
    if best:
        set_pdl(False)
        cfg = Fp8GemvConfig(*best["config"])
        row["bf16_best_no_pdl_us"] = time_graph(lambda i: gemv(x, ws[i % len(ws)], config=cfg), CALLS)
    for pdl in (True, False):
        set_pdl(pdl)
        row[f"fp8_rel_err"] = rel_err(fp8_gemv(x, q, scale), ref8)
        row[f"fp8_{'pdl' if pdl else 'no_pdl'}_us"] = time_graph(lambda i: fp8_gemv(x, qs[i % len(qs)], scale), CALLS)
    gbs = lambda us, nbytes: round(nbytes / us / 1e3)  # noqa: E731
    print(f"{name:>8} cuBLAS {row['cublas_us']:6.1f}us {gbs(row['cublas_us'], 2 * n * k)}GB/s | triton bf16 best "
          + (f"{best['us']:6.1f}us {gbs(best['us'], 2 * n * k)}GB/s {tuple(best['config'])} no-PDL "
             f"{row['bf16_best_no_pdl_us']:6.1f}" if best else "none")
          + f" | fp8 PDL {row['fp8_pdl_us']:6.1f}us {gbs(row['fp8_pdl_us'], n * k)}GB/s no-PDL {row['fp8_no_pdl_us']:6.1f}"
          f" err {row['fp8_rel_err']:.1e}", flush=True)
    return row


def bench_step(model: str, rows: dict, gen) -> dict:
    """One decode step's layer linears back to back in one graph (distinct weights per layer), per path."""
    spec = MODELS[model]
    layers = spec["layers"]
    weights = {s: [torch.randn(n, k, device="cuda", generator=gen).bfloat16().mul_(0.02) for _ in range(layers)]
               for s, (n, k) in spec["shapes"].items()}
    fp8 = {s: [quant_ops.quantize_fp8_per_channel(w.float()) for w in ws] for s, ws in weights.items()}
    hidden = spec["shapes"]["o"][0]
    x = torch.randn(1, hidden, device="cuda", generator=gen).bfloat16()
    inter = spec["shapes"]["down"][1]
    best = {s: Fp8GemvConfig(*rows[s]["bf16_best"]["config"]) for s in spec["shapes"] if rows[s].get("bf16_best")}

    def step(linear):
        def run(_):
            h = x
            for i in range(layers):
                qkv = linear("qkv", i, h)
                o = linear("o", i, qkv[:, :spec["shapes"]["o"][1]])  # strided views: no copy kernels
                gu = linear("gate_up", i, o)
                h = linear("down", i, gu[:, :inter])
            return h
        return run

    out = {"layers": layers}
    out["cublas_ms"] = time_graph(step(lambda s, i, h: F.linear(h, weights[s][i])), 1) / 1000
    for pdl in (True, False):
        set_pdl(pdl)
        tag = "pdl" if pdl else "no_pdl"
        if len(best) == 4:
            out[f"triton_bf16_{tag}_ms"] = time_graph(step(lambda s, i, h: gemv(h, weights[s][i], config=best[s])),
                                                      1) / 1000
        out[f"fp8_{tag}_ms"] = time_graph(step(lambda s, i, h: fp8_gemv(h, *fp8[s][i])), 1) / 1000
    print(f"{model} decode-step layer linears: " + ", ".join(f"{k} {v:.3f}" for k, v in out.items() if k != "layers"),
          flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    import triton

    out_dir = Path(os.environ.get("OUT", "/tmp/out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    started = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    report = {"device": props.name, "torch": torch.__version__, "triton": triton.__version__,
              "config_fields": list(Fp8GemvConfig._fields), "models": {}}
    for model in args.models.split(","):
        rows = {s: bench_shape(f"{model[:5]}:{s}", n, k, gen) for s, (n, k) in MODELS[model]["shapes"].items()}
        torch.cuda.empty_cache()
        report["models"][model] = {"shapes": rows, "step": bench_step(model, rows, gen)}
        torch.cuda.empty_cache()
    report["seconds"] = round(time.time() - started, 1)
    (out_dir / "gemv_pdl.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out_dir / 'gemv_pdl.json'} ({report['seconds']}s)")


if __name__ == "__main__":
    main()
