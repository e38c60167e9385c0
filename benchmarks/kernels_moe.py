"""The mixture-of-experts layer on a GPU, alone, against its bandwidth and compute bounds, batch size by batch size.

    python benchmarks/kernels_moe.py [--model qwen3-moe-15b-a3b] [--ms 1,2,4,...,512,2048,8192] [--fp8 block|channel]
        [--vllm] [--sweep-tiles [--tma]] [--json results.json]

For the MoE layer of a named shape (experts, top-k, hidden and expert width from its config) and M tokens it
times, from CUDA graphs (how the engine runs decode), the platform's routing and fused experts
(``FusedOps.select_experts`` then ``FusedOps.fused_moe``: what :class:`dovetail.layers.moe.FusedMoE` runs),
and with ``--vllm`` vLLM's ``fused_experts`` on the same operands when vLLM is installed. Each graph runs
``CALLS`` layers on different router logits (different experts each time, so expert weights come from HBM,
not L2); a time is the median of ``REPLAYS`` replays. Results are first checked against the plain path.

Bounds, per layer call:

- bytes: the weights of the distinct experts the call routes to (counted from its routing), plus the tokens
  in and out and the intermediate rows written and read (``tokens * top_k`` rows of the expert width and of
  the hidden size); the bandwidth bound is bytes / the measured device-to-device copy bandwidth;
- FLOPs: ``2 * tokens * top_k * 3 * hidden * inter``; the compute bound is FLOPs / the measured bf16 peak
  (a large ``torch.mm``, or ``--peak-tflops``).

Prints µs per layer, achieved GB/s and TFLOP/s, and each as a fraction of its bound (``of bound`` is the larger
bound over the time: 1.0 is the roofline), with the tile configuration used; then one decode step's MoE
layers summed over the model's layers.

``--sweep-tiles`` times instead each grouped GEMM (gate/up, down) alone over a grid of tiles wider than the
tuner's candidates (``dovetail.triton.moe_configs``), for each ``block_m`` the tuner would try at each M:
the five fastest, the fastest of the tuner's candidates, and the expert weights read per second (bf16). With
``--tma`` every tile is timed twice, its weight tiles read by address and through a tensor descriptor
(``GemmConfig.tma``), and the fastest of each kind is printed too.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from kernels_linear import CALLS, SHARED_MEMORY, time_graph


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read plus write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_graph(lambda i: dst.copy_(src))
    return 2 * src.numel() / (us * 1e-6)


def bf16_peak() -> float:
    """FLOP/s of an 8192^3 bf16 ``torch.mm``."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us = time_graph(lambda i: torch.mm(a, b))
    return 2 * 8192**3 / (us * 1e-6)


def quantize_experts(w: torch.Tensor, mode: str):
    from dovetail.quantization import quant_ops

    if mode == "channel":
        parts = [quant_ops.quantize_fp8_per_channel(e) for e in w]
        return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])
    e, n, k = w.shape
    blocks = w.float().reshape(e, n // 128, 128, k // 128, 128)
    scale = (blocks.abs().amax(dim=(2, 4)) / quant_ops.FP8_MAX).clamp(min=1e-12)
    return (blocks / scale[:, :, None, :, None]).reshape(e, n, k).to(quant_ops.fp8_dtype()), scale


def vllm_fused_experts():
    import importlib

    errors = []
    for module in ("vllm.model_executor.layers.fused_moe.fused_moe", "vllm.model_executor.layers.fused_moe"):
        try:
            return importlib.import_module(module).fused_experts
        except Exception as exc:  # not installed, or an API that moved
            errors.append(f"{module}: {type(exc).__name__}: {exc}")
    print("vLLM's fused_experts is not available: " + "; ".join(errors))
    return None


def bench(config, ms: list[int], ops, fp8_mode: str | None, with_vllm: bool, bandwidth: float, peak: float) -> dict:
    from dovetail.moe_ops import Fp8ExpertScales, fused_experts

    experts, top_k = config.num_experts, config.num_experts_per_tok
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * hidden**-0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) * inter**-0.5).bfloat16()
    fp8 = None
    if fp8_mode:
        (w13, s13), (w2, s2) = quantize_experts(w13, fp8_mode), quantize_experts(w2, fp8_mode)
        fp8 = Fp8ExpertScales(s13, s2, (128, 128) if fp8_mode == "block" else None)
    weight_bytes = 3 * hidden * inter * w13.element_size()
    vllm = vllm_fused_experts() if with_vllm and fp8 is None else None
    rows = {}
    for m in ms:
        x = torch.randn(m, hidden, device="cuda", generator=gen).bfloat16()
        logits = [torch.randn(m, experts, device="cuda", generator=gen).bfloat16() for _ in range(CALLS)]
        routed = [ops.select_experts(lg, top_k, True) for lg in logits]
        distinct = statistics.mean(len(torch.unique(ids)) for _, ids in routed)
        moved = distinct * weight_bytes + 2 * m * hidden * 2 + m * top_k * (2 * inter + 2 * hidden) * 2
        flops = 2 * m * top_k * 3 * hidden * inter
        bound_us = max(moved / bandwidth, flops / peak) * 1e6
        expected = fused_experts(x, w13, w2, *routed[0], fp8=fp8)
        paths = {"dovetail": lambda i: ops.fused_moe(x, w13, w2, *ops.select_experts(logits[i], top_k, True),
                                                     fp8=fp8)}
        if vllm is not None:
            paths["vllm"] = lambda i: vllm(x, w13, w2, *routed[i])
        row = {"distinct_experts": distinct, "bytes": moved, "flops": flops, "bound_us": bound_us}
        for name, fn in paths.items():
            try:
                out = fn(0)
                err = float((out.float() - expected.float()).abs().max() / expected.float().abs().max())
                us = time_graph(fn)
                row[name] = {"us": us, "rel_err": err, "GB/s": moved / us / 1e3, "TFLOP/s": flops / us / 1e6,
                             "of_bandwidth": moved / bandwidth * 1e6 / us, "of_compute": flops / peak * 1e6 / us,
                             "of_bound": bound_us / us}
            except Exception as exc:  # report it and go on with the next path
                row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                torch.cuda.synchronize()
        row["config"] = _config_used(m, x, w13, top_k, fp8)
        rows[m] = row
        cells = [f"{n} {r['us']:.1f}us {r['GB/s']:.0f}GB/s ({r['of_bandwidth']:.0%}) {r['TFLOP/s']:.1f}TFLOP/s "
                 f"({r['of_compute']:.0%}) of bound {r['of_bound']:.0%} err {r['rel_err']:.0e}"
                 if "us" in r else f"{n} {r['error']}" for n, r in ((n, row[n]) for n in paths)]
        print(f"M={m:<5} experts {distinct:5.1f} bound {bound_us:7.1f}us | " + " | ".join(cells)
              + f" | {row['config']}", flush=True)
    return rows


#: The tiles ``--sweep-tiles`` times (BLOCK_N x BLOCK_K x stages, 4 warps; 8 warps too at BLOCK_N 128).
SWEEP_BLOCK_N, SWEEP_BLOCK_K, SWEEP_STAGES = (32, 64, 128), (64, 128, 256), (3, 4, 5)


def sweep_tiles(config, ms: list[int], tma: bool = False) -> list[dict]:
    from dovetail.triton.moe_align import align_pairs
    from dovetail.triton.moe_configs import LayerShape, block_m_candidates, gemm_candidates
    from dovetail.triton.moe_gemm import GemmConfig, grouped_gemm

    experts, top_k = config.num_experts, config.num_experts_per_tok
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    shape = LayerShape(experts, inter, hidden, top_k, "bfloat16", "none")
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * hidden**-0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) * inter**-0.5).bfloat16()
    results = []
    for m in ms:
        x = torch.randn(m, hidden, device="cuda", generator=gen).bfloat16()
        h = torch.randn(m * top_k, inter, device="cuda", generator=gen).bfloat16()
        ids = [torch.rand(m, experts, device="cuda", generator=gen).topk(top_k, dim=-1).indices.int()
               for _ in range(CALLS)]
        distinct = statistics.mean(len(torch.unique(i)) for i in ids)
        up_out = torch.empty(m * top_k, inter, device="cuda", dtype=torch.bfloat16)
        down_out = torch.empty(m * top_k, hidden, device="cuda", dtype=torch.bfloat16)
        for block_m in block_m_candidates(m, shape):
            aligned = [align_pairs(i, experts, block_m) for i in ids]
            for gated in (True, False):
                candidates = gemm_candidates(block_m, gated)
                grid = [GemmConfig(n, k, 1, warps, stages) for n in SWEEP_BLOCK_N for k in SWEEP_BLOCK_K
                        for stages in SWEEP_STAGES for warps in ((4, 8) if n == 128 else (4,))
                        if stages * (block_m + (2 if gated else 1) * n) * k * 2 <= SHARED_MEMORY]
                tiles = grid + [c for c in candidates if c not in grid]
                if tma:
                    tiles += [c._replace(tma=True) for c in tiles]
                timed = []
                for c in tiles:
                    if gated:
                        fn = lambda i, c=c: grouped_gemm(x, w13, up_out, aligned[i], c, top_k, gated=True)
                    else:
                        fn = lambda i, c=c: grouped_gemm(h, w2, down_out, aligned[i], c, 1)
                    try:
                        timed.append((time_graph(fn), c))
                    except Exception:  # a tile this GPU cannot run
                        torch.cuda.synchronize()
                timed.sort(key=lambda t: t[0])
                weights = distinct * (2 if gated else 1) * inter * hidden * 2
                best_candidate = next(((us, c) for us, c in timed if c in candidates), None)
                row = {"m": m, "block_m": block_m, "gemm": "gate/up" if gated else "down",
                       "fastest": [{"us": us, "config": c.as_dict(), "TB/s": weights / us / 1e6} for us, c in timed[:5]],
                       "fastest_candidate": best_candidate and {"us": best_candidate[0],
                                                                "config": best_candidate[1].as_dict()}}
                by_kind = {kind: next(((us, c) for us, c in timed if c.tma == through), None)
                           for kind, through in (("by_address", False), ("through_descriptor", True))}
                if tma:
                    row.update({kind: best and {"us": best[0], "config": best[1].as_dict()}
                                for kind, best in by_kind.items()})
                results.append(row)
                print(f"M={m:<4} block_m {block_m:3} {row['gemm']:7}: "
                      + ", ".join(f"{us:.1f}us {weights / us / 1e6:.2f}TB/s {tuple(c)}" for us, c in timed[:5])
                      + (f" | tuner's best {best_candidate[0]:.1f}us {tuple(best_candidate[1])}" if best_candidate else "")
                      + "".join(f" | best {kind.replace('_', ' ')} {best[0]:.1f}us {tuple(best[1])}"
                                for kind, best in by_kind.items() if tma and best),
                      flush=True)
    return results


def _config_used(m: int, x, w13, top_k: int, fp8) -> str:
    from dovetail.triton import fused_moe

    try:
        shape = fused_moe.layer_shape(x, w13, top_k, fp8)
        return fused_moe.select_config(m, shape, w13, None, fp8).describe()  # tuned by the run above
    except Exception as exc:  # another platform's fused ops
        return f"({type(exc).__name__})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-moe-15b-a3b")
    p.add_argument("--device", default=None, help="the platform (default: auto-selected)")
    p.add_argument("--ms", default="1,2,4,8,16,32,64,128,256,512,2048,8192")
    p.add_argument("--fp8", choices=["block", "channel"], default=None, help="FP8 experts (128x128 block or "
                                                                              "per-channel scales)")
    p.add_argument("--vllm", action="store_true", help="also vLLM's fused_experts, when vLLM is installed")
    p.add_argument("--peak-tflops", type=float, default=None, help="the bf16 peak (default: measured)")
    p.add_argument("--sweep-tiles", action="store_true", help="time each grouped GEMM over a grid of tiles instead")
    p.add_argument("--tma", action="store_true", help="with --sweep-tiles: each tile also through a tensor descriptor")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from dovetail import selection
    from dovetail.bench import shapes

    platform = selection.create_platform(selection.resolve_platform_name(args.device))
    platform.device(0)
    ops = platform.fused_ops()
    config = shapes.SHAPES[args.model].config()
    if args.sweep_tiles:
        rows = sweep_tiles(config, [int(v) for v in args.ms.split(",")], tma=args.tma)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "gpu": torch.cuda.get_device_name(), "sweep_tiles": rows}, f, indent=1)
        return
    bandwidth = copy_bandwidth()
    peak = args.peak_tflops * 1e12 if args.peak_tflops else bf16_peak()
    results = {"model": args.model, "gpu": torch.cuda.get_device_name(), "fused_ops": type(ops).__name__,
               "fp8": args.fp8, "copy_GB/s": bandwidth / 1e9, "bf16_peak_TFLOP/s": peak / 1e12}
    print(json.dumps(results))
    torch.cuda.empty_cache()
    ms = [int(v) for v in args.ms.split(",")]
    results["layer"] = rows = bench(config, ms, ops, args.fp8, args.vllm, bandwidth, peak)
    layers = config.num_hidden_layers
    for m in ms:
        if m <= 512:
            step = {n: layers * r["us"] / 1000 for n, r in rows[m].items() if isinstance(r, dict) and "us" in r}
            print(f"one decode step's {layers} MoE layers, M={m}: "
                  + ", ".join(f"{n} {ms_:.3f} ms" for n, ms_ in step.items())
                  + f" (bound {layers * rows[m]['bound_us'] / 1000:.3f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
