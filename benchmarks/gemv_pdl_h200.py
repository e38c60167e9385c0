"""Batch-1 linears on the GPU: cuBLAS against the Triton GEMV (16-bit and FP8 weights), and where PDL triggers.

For the linear shapes of llama-3.1-8b and qwen3-0.6b at one token, times from CUDA graphs (how the engine
runs decode; each graph runs ``CALLS`` products cycling over enough weight copies that none is read from
L2; median of 10 replays, by ``fp8_gemv_h200.time_graph``):

1. per shape (the LM head too) and M in 1-16: cuBLAS bf16 ``F.linear`` and
   :func:`dovetail.triton.gemv.gemv` with its default config and with the tensor-core tiles; at M=1 a
   small grid of configs, and a grid of FP8 configs (tensor-core tiles and register sums); programmatic
   dependent launch (PDL) on;
2. one decode step's layer linears in a single graph (qkv, o, gate_up, down for every layer, back to back),
   cuBLAS against both GEMVs, the PDL trigger at completion (0) or after the main loop (2). GEMVs back to
   back favour trigger 0 for FP8; in the engine, where small kernels sit between them, 2 was faster.

Results (µs per product and GB/s of weight read) go to ``$OUT/gemv_pdl.json``. Checks each Triton result
against the float reference first. Usage: ``python3 benchmarks/gemv_pdl_h200.py [--models llama-3.1-8b]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))

from dovetail.quantization import quant_ops  # noqa: E402
from dovetail.triton import gemv as gemv_module  # noqa: E402
from dovetail.triton.gemv import GemvConfig, default_config, fp8_gemv, gemv, split_k_for  # noqa: E402
from fp8_gemv_h200 import time_graph  # noqa: E402  (benchmarks/, this script's directory)

MODELS = {
    "llama-3.1-8b": {"layers": 32, "shapes": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                                              "down": (4096, 14336)}, "lm_head": (128256, 4096)},
    "qwen3-0.6b": {"layers": 28, "shapes": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024),
                                            "down": (1024, 3072)}, "lm_head": (151936, 1024)},
}
CALLS = 16
COPY_BYTES = 256 << 20
MS = (1, 2, 4, 8, 16)
#: (block_n, block_k, num_warps, num_stages, split_k, dot) tried for 16-bit weights at one token.
GRID = [(8, 1024, 4, 3, 1, False), (8, 2048, 4, 3, 1, False), (4, 2048, 4, 3, 1, False), (16, 1024, 8, 3, 1, False),
        (8, 1024, 8, 3, 1, False), (4, 1024, 4, 3, 1, False), (8, 1024, 4, 4, 1, False), (8, 1024, 4, 2, 1, False),
        (8, 512, 4, 3, 1, False), (8, 1024, 4, 3, 2, False)]
#: FP8 at one token (block_n, block_k, num_warps, num_stages, dot), split until MIN_PROGRAMS: tensor-core tiles,
#: then register sums over a few weight rows (the bf16 GEMV's fine-grained programs).
FP8_GRID = [(64, 256, 4, 3, True), (64, 128, 4, 5, True), (64, 256, 4, 4, True), (64, 512, 4, 3, True),
            (32, 512, 4, 3, True), (32, 256, 4, 3, True), (16, 256, 4, 3, True), (16, 512, 4, 3, True),
            (128, 128, 4, 3, True), (128, 256, 4, 3, True), (8, 1024, 4, 3, False), (8, 2048, 8, 3, False),
            (16, 1024, 8, 3, False), (16, 512, 4, 3, False), (4, 2048, 4, 3, False), (32, 512, 8, 3, False)]


def set_pdl(on: bool) -> None:
    gemv_module.use_pdl = lambda device: on


def rel_err(out, ref) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max())


def bench_shape(name, n, k, gen) -> dict:
    """cuBLAS and the Triton GEMV (default config per M, the grid at M=1); FP8 tiles and register sums at M=1."""
    set_pdl(True)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    q, scale = quant_ops.quantize_fp8_per_channel(w)
    ws = [w.bfloat16() for _ in range(max(1, -(-COPY_BYTES // (2 * n * k))))]
    qs = [q] + [q.clone() for _ in range(max(1, -(-COPY_BYTES // (n * k))) - 1)]
    del w
    x_all = torch.randn(max(MS), k, device="cuda", generator=gen).bfloat16()
    row = {"n": n, "k": k, "m": {}}
    dot16 = default_config(16, n, k, 1)._replace(pdl_trigger=2)  # the tensor-core tiles, for 16-bit weights
    for m in MS:
        x = x_all[:m]
        ref = x.float() @ ws[0].float().t()
        cell = {"cublas_us": time_graph(lambda i: F.linear(x, ws[i % len(ws)]), CALLS),
                "default": list(default_config(m, n, k, 2)), "default_err": rel_err(gemv(x, ws[0]), ref),
                "default_us": time_graph(lambda i: gemv(x, ws[i % len(ws)]), CALLS),
                "dot_us": time_graph(lambda i: gemv(x, ws[i % len(ws)], config=dot16), CALLS)}
        row["m"][m] = cell
        print(f"{name:>14} M={m:<2} cuBLAS {cell['cublas_us']:6.1f}us {2 * n * k / cell['cublas_us'] / 1e3:5.0f}GB/s | "
              f"gemv {cell['default_us']:6.1f}us {2 * n * k / cell['default_us'] / 1e3:5.0f}GB/s "
              f"err {cell['default_err']:.1e} | dot tiles {cell['dot_us']:6.1f}us", flush=True)
    x = x_all[:1]
    configs = []
    for spec in GRID:
        cfg = GemvConfig(*spec)
        try:
            us = time_graph(lambda i, cfg=cfg: gemv(x, ws[i % len(ws)], config=cfg), CALLS)
            configs.append({"config": list(cfg), "us": us})
        except Exception as exc:
            configs.append({"config": list(cfg), "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            torch.cuda.synchronize()
    row["grid_m1"] = sorted(configs, key=lambda c: c.get("us", 1e9))
    ref8 = x.float() @ (q.float() * scale[:, None]).t()
    row["fp8_default_us"] = time_graph(lambda i: fp8_gemv(x, qs[i % len(qs)], scale), CALLS)
    fp8_configs = []
    for bn, bk, warps, stages, dot in FP8_GRID:
        cfg = GemvConfig(bn, bk, warps, stages, split_k_for(n, k, bn, bk), dot)
        try:
            err = rel_err(fp8_gemv(x, q, scale, config=cfg), ref8)
            us = time_graph(lambda i, cfg=cfg: fp8_gemv(x, qs[i % len(qs)], scale, config=cfg), CALLS)
            fp8_configs.append({"config": list(cfg), "us": us, "rel_err": err})
        except Exception as exc:
            fp8_configs.append({"config": list(cfg), "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            torch.cuda.synchronize()
    row["fp8_grid_m1"] = sorted(fp8_configs, key=lambda c: c.get("us", 1e9))
    best, best8 = row["grid_m1"][0], row["fp8_grid_m1"][0]
    print(f"{name:>14} M=1 grid best {best.get('us', 0):6.1f}us {tuple(best['config'])} | fp8 default "
          f"{row['fp8_default_us']:6.1f}us {n * k / row['fp8_default_us'] / 1e3:5.0f}GB/s, best "
          f"{best8.get('us', 0):6.1f}us {tuple(best8['config'])} err {best8.get('rel_err', 1):.1e}", flush=True)
    return row



def step_operands(model: str, gen):
    """A decode step's layer weights (bf16, and FP8 with scales: shape -> one per layer), its one-token input,
    and the widths of the o projection's input and the down projection's input."""
    spec = MODELS[model]
    weights = {s: [torch.randn(n, k, device="cuda", generator=gen).bfloat16().mul_(0.02) for _ in range(spec["layers"])]
               for s, (n, k) in spec["shapes"].items()}
    fp8 = {s: [quant_ops.quantize_fp8_per_channel(w.float()) for w in ws] for s, ws in weights.items()}
    x = torch.randn(1, spec["shapes"]["o"][0], device="cuda", generator=gen).bfloat16()
    return weights, fp8, x, spec["shapes"]["o"][1], spec["shapes"]["down"][1]


def bench_step(model: str, gen, fp8_best: dict) -> dict:
    """One decode step's layer linears back to back in one graph (distinct weights per layer), per path and
    PDL trigger (0: at completion, 2: after the main loop); FP8 also with ``fp8_best`` (shape -> the fastest
    FP8 config at one token in :func:`bench_shape`)."""
    spec = MODELS[model]
    layers = spec["layers"]
    weights, fp8, x, o_in, inter = step_operands(model, gen)

    def step(linear):
        def run(_):
            h = x
            for i in range(layers):
                qkv = linear("qkv", i, h)
                o = linear("o", i, qkv[:, :o_in])  # strided views: no copy kernels
                gu = linear("gate_up", i, o)
                h = linear("down", i, gu[:, :inter])
            return h
        return run

    def cfg(s, weight_bytes, trigger):
        n, k = spec["shapes"][s]
        return default_config(1, n, k, weight_bytes)._replace(pdl_trigger=trigger)

    out = {"layers": layers, "cublas_ms": time_graph(step(lambda s, i, h: F.linear(h, weights[s][i])), 1) / 1000}
    set_pdl(True)
    for trigger in (0, 2):
        out[f"bf16_trigger{trigger}_ms"] = time_graph(
            step(lambda s, i, h: gemv(h, weights[s][i], config=cfg(s, 2, trigger))), 1) / 1000
        out[f"fp8_trigger{trigger}_ms"] = time_graph(
            step(lambda s, i, h: fp8_gemv(h, *fp8[s][i], config=cfg(s, 1, trigger))), 1) / 1000
        out[f"fp8_best_trigger{trigger}_ms"] = time_graph(step(lambda s, i, h: fp8_gemv(
            h, *fp8[s][i], config=fp8_best[s]._replace(pdl_trigger=trigger))), 1) / 1000
    out["fp8_best"] = {s: list(c) for s, c in fp8_best.items()}
    print(f"{model} decode-step layer linears (ms): "
          + ", ".join(f"{k[:-3]} {v:.3f}" for k, v in out.items() if k.endswith("_ms")), flush=True)
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
              "config_fields": list(GemvConfig._fields), "models": {}}
    for model in args.models.split(","):
        shapes = dict(MODELS[model]["shapes"], lm_head=MODELS[model]["lm_head"])
        rows = {s: bench_shape(f"{model[:5]}:{s}", n, k, gen) for s, (n, k) in shapes.items()}
        torch.cuda.empty_cache()
        best = {s: GemvConfig(*next(c["config"] for c in rows[s]["fp8_grid_m1"] if c.get("us")))
                for s in MODELS[model]["shapes"]}
        report["models"][model] = {"shapes": rows, "step": bench_step(model, gen, best)}
        torch.cuda.empty_cache()
    report["seconds"] = round(time.time() - started, 1)
    (out_dir / "gemv_pdl.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out_dir / 'gemv_pdl.json'} ({report['seconds']}s)")


if __name__ == "__main__":
    main()
