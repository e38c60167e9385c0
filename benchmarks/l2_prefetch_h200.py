"""L2 prefetch of the next linear's weights by the CUDA FP8 GEMV, over one decode step of llama-3.1-8b's layers.

Per layer, in one CUDA graph: the qkv GEMV, a spin kernel standing for rotary + attention (``--attn-us``), the o
GEMV, a spin for the RMSNorm (``--norm-us``), the gate/up GEMV with SiLU-and-mul, the down GEMV, and a spin for
the next RMSNorm. Every layer has its own weights (7 GB in all), so nothing stays in L2 from one layer to the next
by itself. A variant gives the GEMVs of some shapes (``from``) a prefetch of the next GEMV's leading bytes (at
most ``limit`` MiB, with L2's normal or evict-last priority), as ``dovetail_cuda.prefetch_chain`` does in the
engine; limit 0 is the baseline. The spins alone give the floor the GEMVs add to.

Writes ``$OUT/l2_prefetch.json``. Usage: ``python3 benchmarks/l2_prefetch_h200.py [--attn-us 5 --norm-us 1.5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dovetail_cuda.fp8_gemv import GATED_DEFAULT, fp8_gemv, prefetch_of  # noqa: E402
from fp8_gemv_h200 import time_graph  # noqa: E402
from gemv_pdl_h200 import MODELS, rel_err, step_operands  # noqa: E402

SHAPES = ("qkv", "o", "gate_up", "down")
ALL = frozenset(SHAPES)
VARIANTS = ([(0, False, ALL)] + [(mb, last, ALL) for mb in (4, 8, 16, 24, 32, 48) for last in (False, True)]
            + [(mb, False, frozenset({"qkv", "o"})) for mb in (16, 32)]
            + [(mb, False, frozenset({"qkv", "o", "down"})) for mb in (16, 32)])


def spin_cycles_per_us() -> float:
    cycles = 20000
    return cycles / time_graph(lambda i: torch.cuda._sleep(cycles), 16)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--attn-us", type=float, default=5.0)
    parser.add_argument("--norm-us", type=float, default=1.5)
    args = parser.parse_args()
    out_dir = Path(os.environ.get("OUT", "/tmp/out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    rate = spin_cycles_per_us()
    attn, norm = int(args.attn_us * rate), int(args.norm_us * rate)
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = MODELS["llama-3.1-8b"]["layers"]
    weights, fp8, x, o_in, inter = step_operands("llama-3.1-8b", gen)
    del weights
    torch.cuda.empty_cache()
    order = [(s, i) for i in range(layers) for s in SHAPES]

    def run_step(limit: int, evict_last: bool, sources: frozenset, spins: bool = True, gemvs: bool = True):
        ahead = {}
        for (s, i), (t, j) in zip(order, order[1:] + order[:1]):
            if limit and s in sources:
                ahead[s, i] = prefetch_of(fp8[t][j][0], t == "gate_up", limit, evict_last)

        def gemv(s, i, h, gated=False):
            return fp8_gemv(h, *fp8[s][i], gated=gated, config=GATED_DEFAULT if gated else None,
                            prefetch=ahead.get((s, i)))

        def run(_):
            h = x
            for i in range(layers):
                qkv = gemv("qkv", i, h) if gemvs else h
                if spins:
                    torch.cuda._sleep(attn)
                o = gemv("o", i, qkv[:, :o_in]) if gemvs else h
                if spins:
                    torch.cuda._sleep(norm)
                h = gemv("down", i, gemv("gate_up", i, o, gated=True)) if gemvs else h
                if spins:
                    torch.cuda._sleep(norm)
            return h
        return run

    baseline = run_step(0, False, ALL)(0)
    report = {"device": torch.cuda.get_device_name(0), "attn_us": args.attn_us, "norm_us": args.norm_us,
              "spins_only_ms": time_graph(run_step(0, False, ALL, gemvs=False), 1) / 1000,
              "gemvs_only_ms": time_graph(run_step(0, False, ALL, spins=False), 1) / 1000, "variants": []}
    print(f"spins only {report['spins_only_ms']:.3f} ms, GEMVs only {report['gemvs_only_ms']:.3f} ms", flush=True)
    for limit_mb, evict_last, sources in VARIANTS:
        step = run_step(limit_mb << 20, evict_last, sources)
        same = rel_err(step(0), baseline.float())
        ms = time_graph(step, 1) / 1000
        row = {"limit_mb": limit_mb, "evict_last": evict_last, "from": sorted(sources), "ms": ms, "rel_err": same}
        report["variants"].append(row)
        print(f"prefetch {limit_mb:>2} MiB {'evict_last' if evict_last else 'normal':>10} from {','.join(sorted(sources))}:"
              f" {ms:.3f} ms (GEMVs {ms - report['spins_only_ms']:.3f}); output vs baseline {same:.1e}", flush=True)
    report["seconds"] = round(time.time() - started, 1)
    (out_dir / "l2_prefetch.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
