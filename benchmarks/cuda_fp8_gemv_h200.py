"""One-token FP8 linears on the GPU: the CUDA C++ GEMV (``dovetail_cuda.fp8_gemv``) against the Triton one.

For llama-3.1-8b's layer linear shapes, times from CUDA graphs (``fp8_gemv_h200.time_graph``:
16 products a graph over weight copies larger than L2, median of 10 replays), PDL on:

1. every e4m3 byte through the CUDA kernel (exact, or the script stops);
2. per shape: the Triton FP8 GEMV's default, the Triton bf16 GEMV on the bf16 weight, and each CUDA config
   (rows a warp group owns, K steps in flight, when the next kernel may launch, warps a block, warps a group), with
   its error against the float reference; for gate_up, each config also with SiLU-and-mul fused (``gated``);
3. one decode step's layer linears back to back in one graph (qkv, o, gate_up, down for 32 layers): Triton
   FP8, Triton bf16, CUDA with the best config per shape, and each CUDA config everywhere; and the CUDA
   default with the SiLU-and-mul kernel after gate_up against the gate_up GEMV with SiLU-and-mul fused, and the
   best config per shape with gate_up's best gated config.

Writes ``$OUT/cuda_fp8_gemv.json``. Usage: ``python3 benchmarks/cuda_fp8_gemv_h200.py``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dovetail.quantization import quant_ops  # noqa: E402
from dovetail.triton.activation import act_and_mul  # noqa: E402
from dovetail.triton.gemv import fp8_gemv as triton_fp8_gemv, gemv as triton_gemv  # noqa: E402
from dovetail_cuda import native  # noqa: E402
from dovetail_cuda.fp8_gemv import SOURCE, NativeGemvConfig, fp8_gemv  # noqa: E402
from fp8_gemv_h200 import time_graph  # noqa: E402
from gemv_pdl_h200 import CALLS, COPY_BYTES, MODELS, rel_err, step_operands  # noqa: E402

#: The ninth session's defaults and neighbours, then warps sharing each output's K (split).
CONFIGS = ([NativeGemvConfig(1, 2, 2), NativeGemvConfig(1, 1, 3), NativeGemvConfig(2, 2, 2), NativeGemvConfig(1, 2, 2, 8),
            NativeGemvConfig(1, 1, 3, 8)]
           + [NativeGemvConfig(r, u, t, w, s) for r, u, t in ((1, 2, 2), (1, 1, 3), (2, 2, 2))
              for w, s in ((2, 2), (4, 2), (8, 2), (16, 2))])


def check_every_byte() -> None:
    """Row i of the weight is byte i repeated; x is ones, so y[i] = 16 * value(i), exact in bfloat16."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8, device="cuda")
    weight = codes[:, None].expand(-1, 16).contiguous().view(torch.float8_e4m3fn)
    expected = 16 * weight[:, 0].float()
    ones = torch.ones(16, device="cuda")
    for dtype in (torch.bfloat16, torch.float16):
        out = fp8_gemv(ones.to(dtype), weight, torch.ones(len(codes), device="cuda")).float()
        bad = (out != expected).nonzero().flatten().tolist()
        if bad:
            raise SystemExit(f"{dtype}: bytes {[int(codes[i]) for i in bad[:8]]} wrong")
    print("every e4m3 byte exact, bfloat16 and float16", flush=True)


def bench_shape(name: str, n: int, k: int, gen) -> dict:
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    w[:, :7] *= 30
    q, scale = quant_ops.quantize_fp8_per_channel(w)
    qs = [q] + [q.clone() for _ in range(max(1, -(-COPY_BYTES // (n * k))) - 1)]
    ws = [w.bfloat16() for _ in range(max(1, -(-COPY_BYTES // (2 * n * k))))] if n < 65536 else []
    del w
    x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
    ref = x.float() @ (q.float() * scale[:, None]).t()
    row = {"n": n, "k": k, "triton_fp8_us": time_graph(lambda i: triton_fp8_gemv(x, qs[i % len(qs)], scale), CALLS),
           "triton_fp8_err": rel_err(triton_fp8_gemv(x, q, scale), ref), "cuda": []}
    if ws:
        row["triton_bf16_us"] = time_graph(lambda i: triton_gemv(x, ws[i % len(ws)]), CALLS)
    for cfg in CONFIGS:
        err = rel_err(fp8_gemv(x, q, scale, config=cfg), ref)
        us = time_graph(lambda i, cfg=cfg: fp8_gemv(x, qs[i % len(qs)], scale, config=cfg), CALLS)
        row["cuda"].append({"config": list(cfg), "us": us, "rel_err": err})
    row["cuda"].sort(key=lambda c: c["us"])
    if name == "gate_up":
        row["cuda_gated"] = sorted(({"config": list(cfg), "us": time_graph(
            lambda i, cfg=cfg: fp8_gemv(x, qs[i % len(qs)], scale, config=cfg, gated=True), CALLS)} for cfg in CONFIGS),
            key=lambda c: c["us"])
        print("   gated: " + ", ".join(f"{tuple(c['config'])} {c['us']:.1f}" for c in row["cuda_gated"]), flush=True)
    best = row["cuda"][0]
    row["cuda_best_no_pdl_us"] = time_graph(
        lambda i: fp8_gemv(x, qs[i % len(qs)], scale, config=NativeGemvConfig(*best["config"]), pdl=False), CALLS)
    print(f"{name:>8} {n}x{k}: triton fp8 {row['triton_fp8_us']:6.1f}us ({n * k / row['triton_fp8_us'] / 1e3:5.0f} GB/s)"
          f" | bf16 gemv {row.get('triton_bf16_us', 0):6.1f}us | cuda best {best['us']:6.1f}us "
          f"({n * k / best['us'] / 1e3:5.0f} GB/s) {tuple(best['config'])} err {best['rel_err']:.1e}; no PDL "
          f"{row['cuda_best_no_pdl_us']:6.1f}us", flush=True)
    print("          " + ", ".join(f"{tuple(c['config'])} {c['us']:.1f}" for c in row["cuda"]), flush=True)
    return row


def bench_step(gen, best: dict, best_gated: NativeGemvConfig) -> dict:
    layers = MODELS["llama-3.1-8b"]["layers"]
    weights, fp8, x, o_in, inter = step_operands("llama-3.1-8b", gen)

    def step(linear, gate_up=None):
        """gate_up(i, h) -> the down projection's input; None: the first half of ``linear``'s gate_up product."""
        def run(_):
            h = x
            for i in range(layers):
                qkv = linear("qkv", i, h)
                o = linear("o", i, qkv[:, :o_in])
                h = linear("down", i, gate_up(i, o) if gate_up else linear("gate_up", i, o)[:, :inter])
            return h
        return run

    out = {"triton_fp8_ms": time_graph(step(lambda s, i, h: triton_fp8_gemv(h, *fp8[s][i])), 1) / 1000,
           "triton_bf16_ms": time_graph(step(lambda s, i, h: triton_gemv(h, weights[s][i])), 1) / 1000,
           "cuda_best_ms": time_graph(step(lambda s, i, h: fp8_gemv(h, *fp8[s][i], config=best[s])), 1) / 1000,
           "cuda_default_silu_ms": time_graph(step(lambda s, i, h: fp8_gemv(h, *fp8[s][i]), lambda i, h: act_and_mul(
               fp8_gemv(h, *fp8["gate_up"][i]), gelu_tanh=False)), 1) / 1000,
           "cuda_default_gated_ms": time_graph(step(lambda s, i, h: fp8_gemv(h, *fp8[s][i]), lambda i, h: fp8_gemv(
               h, *fp8["gate_up"][i], gated=True)), 1) / 1000,
           "cuda_best_gated_ms": time_graph(step(lambda s, i, h: fp8_gemv(h, *fp8[s][i], config=best[s]), lambda i, h: fp8_gemv(
               h, *fp8["gate_up"][i], gated=True, config=best_gated)), 1) / 1000}
    for cfg in CONFIGS:
        out["cuda_" + "_".join(map(str, cfg)) + "_ms"] = time_graph(
            step(lambda s, i, h, cfg=cfg: fp8_gemv(h, *fp8[s][i], config=cfg)), 1) / 1000
    out["best"] = {s: list(c) for s, c in best.items()}
    print("llama-3.1-8b decode-step layer linears (ms): "
          + ", ".join(f"{k[:-3]} {v:.3f}" for k, v in out.items() if k.endswith("_ms")), flush=True)
    return out


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "/tmp/out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    lib = native.library(SOURCE, 0)
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "build_s": round(time.time() - started, 1), "library": lib is not None and str(lib._name)}
    print(f"{report['device']}: built/loaded {SOURCE} in {report['build_s']} s", flush=True)
    if lib is None:
        raise SystemExit(native.unavailable_reason(SOURCE, 0))
    check_every_byte()
    gen = torch.Generator(device="cuda").manual_seed(0)
    spec = MODELS["llama-3.1-8b"]
    shapes = dict(spec["shapes"])
    report["shapes"] = {s: bench_shape(s, n, k, gen) for s, (n, k) in shapes.items()}
    torch.cuda.empty_cache()
    best = {s: NativeGemvConfig(*report["shapes"][s]["cuda"][0]["config"]) for s in spec["shapes"]}
    report["step"] = bench_step(gen, best, NativeGemvConfig(*report["shapes"]["gate_up"]["cuda_gated"][0]["config"]))
    report["seconds"] = round(time.time() - started, 1)
    (out_dir / "cuda_fp8_gemv.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out_dir / 'cuda_fp8_gemv.json'} ({report['seconds']}s)")


if __name__ == "__main__":
    main()
