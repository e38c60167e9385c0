"""The linear layers' kernels on a GPU: cuBLAS against the engine's GEMVs, 16-bit and FP8, shape by shape.

    python benchmarks/kernels_linear.py [--model llama-3.1-8b] [--ms 1,2,4,8,16,64,256] [--shapes qkv,o]
        [--tp N] [--blas] [--tunable] [--swapped] [--configs] [--gated-configs] [--only PREFIXES] [--best N]
        [--sustain SECONDS] [--json results.json]

For the projections of a named shape (qkv, o, gate_up, down of one layer, the LM head, a mixture of experts'
router) and M tokens it
times, from CUDA graphs (how the engine runs decode):

- ``F.linear`` on 16-bit weights (cuBLAS or cuBLASLt, as the platform set torch up); ``--blas`` adds it under
  each of torch's libraries (``F.linear cublas``, ``F.linear cublaslt``) and ``--tunable`` under torch's
  TunableOp (``F.linear tunableop``: every cuBLASLt algorithm timed for the shape, the fastest kept);
  ``--swapped`` adds the product with its operands swapped, ``weight @ x.T`` (the library then tiles the
  weight's rows as the long side and the tokens as the short one, and picks its kernel for that shape), as a
  transposed view (``swapped view``) and copied back to ``[M, N]`` (``swapped copy``, what a layer would use);
- the platform's ``FusedOps.linear`` (what the engine's 16-bit layers call: a Triton GEMV where the platform
  chose one, else ``F.linear``) and :func:`dovetail.triton.gemv.gemv` with its default configuration;
- FP8 weights (e4m3, per-channel scales): the platform's ``QuantKernels.fp8_linear`` (what the engine's fp8
  layers call), the Triton :func:`~dovetail.triton.gemv.fp8_gemv` and ``torch._scaled_mm`` with per-token
  activation scales; ``--configs`` adds grids of ``GemvConfig`` for the Triton FP8 and 16-bit GEMVs (tensor-core
  tiles, and at up to 4 rows register sums with their split of K), and ``--best N`` prints only the N fastest
  16-bit and the N fastest FP8 paths of each product;
- for gate_up, the product with its SiLU-and-mul: ``F.linear`` then the activation's kernel (``F.linear+act``),
  the platform's ``FusedOps.linear_gated`` (what the engine's MLPs call) and the gated Triton GEMV
  (:func:`~dovetail.triton.gemv.gemv_gated`), with ``--gated-configs`` its tile grid; ``--best N`` keeps the N
  fastest.

``--only`` keeps the paths whose names start with one of its comma-separated prefixes (``--only F.linear`` at
prefill sizes, where the GEMVs have nothing to say).

``--sustain S`` then runs one layer's four products back to back for S seconds at each M, under the library
setting the platform gave torch (the engine's), under each library and (with ``--tunable``) under TunableOp, twice
in turn, and reports the TFLOP/s of each run's second half: the rate at the card's power cap, where the long runs
of large products in prefill steps end up (a graph replay above lasts milliseconds, mostly at full clocks).

Each graph runs ``CALLS`` products cycling over enough weight copies (at least 256 MB) that none is read from
L2; a time is the median of ``REPLAYS`` replays. Every kernel is first checked against the float reference
(largest error relative to the largest output). Prints µs per product, the weight bytes read per second and
the TFLOP/s, then one decode step's layer linears summed over the layers. ``--tp N`` takes one rank's share of
each product under tensor parallelism: output features divided for the column-parallel qkv, gate_up and LM
head, input features for the row-parallel o and down.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F

CALLS = 16
REPLAYS = 10
COPY_BYTES = 256 << 20
#: Extra Triton FP8 GEMV configurations for ``--configs``: (block_n, block_k, num_warps, num_stages, dot).
FP8_GRID = [(64, 256, 4, 3, True), (64, 128, 4, 5, True), (32, 256, 4, 3, True), (128, 128, 4, 3, True),
            (16, 512, 4, 3, True), (8, 1024, 4, 3, False), (16, 1024, 8, 3, False), (16, 512, 4, 3, False)]


#: Shared memory a Hopper multiprocessor gives one program, less a margin: the bound of the tile grids here and in
#: kernels_moe.py (a tile's pipeline stages of 16-bit operands).
SHARED_MEMORY = 220 << 10
#: Extra 16-bit Triton GEMV tiles for ``--configs``: (block_m, block_n, block_k, num_stages), 4 warps, tensor-core
#: dot, those of at most 16 rows more than the product has and that fit ``SHARED_MEMORY``.
BF16_GRID = [(bm, bn, bk, stages) for bm in (16, 32, 64, 128) for bn in (32, 64, 128) for bk in (128, 256)
             for stages in (3, 4) if stages * (bm + bn) * bk * 2 <= SHARED_MEMORY]
#: Extra 16-bit register-sum configurations for ``--configs`` at up to 4 rows (the default there):
#: (block_n, block_k, num_stages, split_k), 4 warps. Few output features (a TP rank's qkv, o and down) give
#: few programs of ``block_n`` rows each; a narrower block or a split of K makes more of them.
BF16_SUM_GRID = [(bn, bk, stages, split) for bn in (4, 8, 16) for bk in (512, 1024) for stages in (2, 3)
                 for split in (1, 2)]


def rank_share(name: str, n: int, k: int, tp: int) -> tuple[int, int]:
    """(N, K) of one of ``tp`` ranks' share of projection ``name`` (the router stays whole)."""
    if name in ("o", "down"):
        return n, k // tp
    if name == "router":
        return n, k
    return n // tp, k


def with_setting(read, write, value, fn):
    """``fn`` run with a process-wide torch setting at ``value`` (``write(value)``), restored after."""
    def call(i):
        before = read()
        write(value)
        try:
            return fn(i)
        finally:
            write(before)
    return call


def with_blas(library: str, fn):
    """``fn`` run with torch's matrix products on ``library``."""
    blas = torch.backends.cuda.preferred_blas_library
    return with_setting(blas, blas, library, fn)


def with_tunable_op(fn):
    """``fn`` run under torch's TunableOp: the first product of a shape times cuBLASLt's algorithms for it."""
    return with_setting(torch.cuda.tunable.is_enabled, torch.cuda.tunable.enable, True, fn)


def time_graph(fn, before_replay=None) -> float:
    """Median µs per call of ``fn(i)`` for i in range(CALLS), captured in one CUDA graph and replayed
    (``before_replay()`` first at each timed replay: a barrier lines several ranks up)."""
    for i in range(CALLS):  # compile and allocate outside the capture
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(i)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        if before_replay is not None:
            before_replay()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS)
    return statistics.median(times)


def sustained_tflops(products, flop: int, seconds: float) -> float:
    """TFLOP/s over the second half of ``seconds`` of ``products`` (callables) run back to back, ``flop`` a round."""
    marks, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds:
        for product in products:
            product(0)
        torch.cuda.synchronize()
        marks.append(time.perf_counter())
    late = [t for t in marks if t - start >= seconds / 2]
    return (len(late) - 1) * flop / (late[-1] - late[0]) / 1e12 if len(late) > 1 else math.nan


def sustain_layer(shapes: dict[str, tuple[int, int]], m: int, seconds: float, tunable: bool) -> dict:
    """One layer's products at ``m`` rows run for ``seconds`` under each library setting, twice in turn."""
    ws = {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for name, (n, k) in shapes.items()}
    xs = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _, k in shapes.values()}
    flop = sum(2 * m * n * k for n, k in shapes.values())
    plain = [lambda i, w=w: F.linear(xs[w.shape[1]], w) for w in ws.values()]
    settings = {"F.linear": plain, **{f"F.linear {lib}": [with_blas(lib, fn) for fn in plain]
                                      for lib in ("cublas", "cublaslt")}}
    if tunable:
        settings["F.linear tunableop"] = [with_tunable_op(with_blas("cublaslt", fn)) for fn in plain]
    rates = {name: [] for name in settings}
    for _ in range(2):
        for name, products in settings.items():
            rates[name].append(sustained_tflops(products, flop, seconds))
    return rates


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max())


def gated_paths(x, ws, ops, configs: bool) -> dict:
    """The gate/up projection with SiLU-and-mul: cuBLAS's product then the activation's kernel, the platform's
    ``FusedOps.linear_gated`` (those two where it has no gated kernel for the size), the gated Triton GEMV, and with
    ``configs`` its tile grid (``block_n`` weight rows a program, half gate and half up)."""
    from dovetail.triton.gemv import GemvConfig, gemv_gated, split_k_for

    n, k = ws[0].shape
    half = n // 2
    full = x.float() @ ws[0].float().t()
    ref = ops.silu_and_mul(full.to(x.dtype)).float()

    def fused(i):
        out = ops.linear_gated(x, ws[i % len(ws)], None, "silu")
        return ops.silu_and_mul(ops.linear(x, ws[i % len(ws)])) if out is None else out

    paths = {"F.linear+act": (lambda i: ops.silu_and_mul(F.linear(x, ws[i % len(ws)])), ref),
             "FusedOps.linear_gated": (fused, ref),
             "triton gemv gated": (lambda i: gemv_gated(x, ws[i % len(ws)]), ref)}
    if configs:
        m = x.shape[0]
        for bm, bn, bk, stages in BF16_GRID:
            if bm > max(16, m) or bn < 32 or half % (bn // 2):
                continue
            cfg = GemvConfig(bn, bk, 4, stages, split_k_for(n, k, bn, bk, m, bm), True, block_m=bm)
            paths[f"triton gemv gated m{bm} n{bn} k{bk} s{stages} split{cfg.split_k}"] = (
                lambda i, cfg=cfg: gemv_gated(x, ws[i % len(ws)], config=cfg), ref)
    return paths


def path_kind(path: str) -> str:
    """What a path computes: ``fp8`` products, ``gated`` (a gate/up product and its activation), else ``16-bit``."""
    if path.startswith("fp8"):
        return "fp8"
    return "gated" if "gated" in path or path.endswith("+act") else "16-bit"


def bench_shape(n: int, k: int, ms: list[int], ops, quant_kernels, configs: bool, blas: bool = False,
                tunable: bool = False, gated: bool = False, gated_configs: bool = False,
                swapped: bool = False, only: tuple[str, ...] = ()) -> dict:
    from dovetail.quantization import quant_ops
    from dovetail.quantization.fp8_scaled_mm import fp8_linear_scaled_mm
    from dovetail.triton.gemv import GemvConfig, fp8_gemv, gemv, split_k_for

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    w[:, :7] *= 30  # outlier columns, as real checkpoints have
    q, scale = quant_ops.quantize_fp8_per_channel(w)
    qs = [q] + [q.clone() for _ in range(max(1, -(-COPY_BYTES // (n * k))) - 1)]
    ws = [w.bfloat16() for _ in range(max(1, -(-COPY_BYTES // (2 * n * k))))]
    del w
    x_all = torch.randn(max(ms), k, device="cuda", generator=gen).bfloat16()
    rows = {}
    for m in ms:
        x = x_all[:m].contiguous()
        ref16 = x.float() @ ws[0].float().t()
        ref8 = x.float() @ (q.float() * scale[:, None]).t()
        paths = {
            "F.linear": (lambda i: F.linear(x, ws[i % len(ws)]), ref16),
            "FusedOps.linear": (lambda i: ops.linear(x, ws[i % len(ws)]), ref16),
            "triton gemv": (lambda i: gemv(x, ws[i % len(ws)]), ref16),
            "fp8 QuantKernels": (lambda i: quant_kernels.fp8_linear(x, qs[i % len(qs)], scale), ref8),
            "fp8 triton gemv": (lambda i: fp8_gemv(x, qs[i % len(qs)], scale), ref8),
            "fp8 scaled_mm": (lambda i: fp8_linear_scaled_mm(x, qs[i % len(qs)], scale), ref8),
        }
        linear = paths["F.linear"][0]
        if swapped:
            paths["F.linear swapped view"] = (lambda i: torch.mm(ws[i % len(ws)], x.t()).t(), ref16)
            paths["F.linear swapped copy"] = (lambda i: torch.mm(ws[i % len(ws)], x.t()).t().contiguous(), ref16)
        if blas:
            for base in ("F.linear", "F.linear swapped copy") if swapped else ("F.linear",):
                for library in ("cublas", "cublaslt"):
                    paths[f"{base} {library}"] = (with_blas(library, paths[base][0]), ref16)
        if tunable:
            paths["F.linear tunableop"] = (with_tunable_op(with_blas("cublaslt", linear)), ref16)
        if configs:
            for bn, bk, warps, stages, dot in FP8_GRID:
                cfg = GemvConfig(bn, bk, warps, stages, split_k_for(n, k, bn, bk), dot)
                paths[f"fp8 triton {tuple(cfg)[:6]}"] = (
                    lambda i, cfg=cfg: fp8_gemv(x, qs[i % len(qs)], scale, config=cfg), ref8)
            for bm, bn, bk, stages in BF16_GRID:
                if bm > max(16, m):
                    continue
                cfg = GemvConfig(bn, bk, 4, stages, split_k_for(n, k, bn, bk, m, bm), True, block_m=bm)
                paths[f"triton gemv m{bm} n{bn} k{bk} s{stages} split{cfg.split_k}"] = (
                    lambda i, cfg=cfg: gemv(x, ws[i % len(ws)], config=cfg), ref16)
            if m <= 4:
                for bn, bk, stages, split in BF16_SUM_GRID:
                    cfg = GemvConfig(bn, bk, 4, stages, split, False)
                    paths[f"triton gemv sums n{bn} k{bk} s{stages} split{split}"] = (
                        lambda i, cfg=cfg: gemv(x, ws[i % len(ws)], config=cfg), ref16)
        if gated:
            paths.update(gated_paths(x, ws, ops, gated_configs))
        row = {}
        for name, (fn, ref) in paths.items():
            if only and not name.startswith(only):
                continue
            try:
                err = rel_err(fn(0), ref)
                row[name] = {"us": time_graph(fn), "rel_err": err}
            except Exception as exc:  # a configuration that does not compile or launch: report it, go on
                row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                torch.cuda.synchronize()
        rows[m] = row
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--device", default=None, help="the platform (default: auto-selected)")
    p.add_argument("--shapes", default="qkv,o,gate_up,down,lm_head")
    p.add_argument("--ms", default="1,2,4,8,16,64,256")
    p.add_argument("--tp", type=int, default=1, help="one rank's share of each product at this tensor-parallel size")
    p.add_argument("--blas", action="store_true", help="also F.linear under cuBLAS and under cuBLASLt")
    p.add_argument("--tunable", action="store_true", help="also F.linear under torch's TunableOp (cuBLASLt, tuned)")
    p.add_argument("--swapped", action="store_true", help="also the product with its operands swapped (weight @ x.T)")
    p.add_argument("--configs", action="store_true", help="also grids of Triton GEMV configurations (FP8, 16-bit)")
    p.add_argument("--gated-configs", action="store_true", help="also the gated Triton GEMV's tile grid (gate_up)")
    p.add_argument("--only", default="", help="comma-separated prefixes: time only the paths whose names start so")
    p.add_argument("--sustain", type=float, default=0,
                   help="also run one layer's products for this many seconds at each M, by library setting")
    p.add_argument("--best", type=int, default=0,
                   help="print only the N fastest 16-bit and N fastest FP8 paths of each product")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.sustain and not {"qkv", "o", "gate_up", "down"} <= set(args.shapes.split(",")):
        p.error("--sustain runs a whole layer: --shapes must name qkv, o, gate_up and down")

    from dovetail import selection
    from dovetail.bench import shapes
    from dovetail.bench.shapes import projections

    platform = selection.create_platform(selection.resolve_platform_name(args.device))
    platform.device(0)
    ops, quant_kernels = platform.fused_ops(), platform.quant_kernels()
    config = shapes.SHAPES[args.model].config()
    ms = [int(v) for v in args.ms.split(",")]
    if args.tunable:
        torch.cuda.tunable.tuning_enable(True)
        torch.cuda.tunable.set_max_tuning_duration(100)  # ms a shape
        if hasattr(torch.cuda.tunable, "write_file_on_exit"):  # keep the tuning out of the working directory
            torch.cuda.tunable.write_file_on_exit(False)
    results = {"model": args.model, "tp": args.tp, "gpu": torch.cuda.get_device_name(), "platform": platform.name,
               "fused_ops": type(ops).__name__, "quant_kernels": type(quant_kernels).__name__, "shapes": {}}
    print(json.dumps({k: v for k, v in results.items() if k != "shapes"}))
    shares = {name: rank_share(name, *projections(config)[name], args.tp) for name in args.shapes.split(",")}
    for name, (n, k) in shares.items():
        results["shapes"][name] = rows = bench_shape(n, k, ms, ops, quant_kernels, args.configs, args.blas,
                                                     args.tunable, gated=name == "gate_up",
                                                     gated_configs=args.gated_configs, swapped=args.swapped,
                                                     only=tuple(filter(None, args.only.split(","))))
        for m, row in rows.items():
            cells = []
            shown = row.items()
            if args.best:
                timed = sorted(((p, r) for p, r in row.items() if "us" in r), key=lambda pr: pr[1]["us"])
                shown = [pr for kind in ("16-bit", "fp8", "gated") for pr in
                         [pr for pr in timed if path_kind(pr[0]) == kind][:args.best]]
                shown += [(p, r) for p, r in row.items()
                          if (p in ("FusedOps.linear", "FusedOps.linear_gated", "triton gemv gated")
                              or p.startswith("F.linear")) and (p, r) not in shown]
            for path, r in shown:
                if "us" in r:
                    weight_bytes = n * k * (1 if path.startswith("fp8") else 2)
                    tflops = 2 * m * n * k / r["us"] / 1e6
                    cells.append(f"{path} {r['us']:.1f}us {weight_bytes / r['us'] / 1e3:.0f}GB/s {tflops:.0f}TF/s "
                                 f"err {r['rel_err']:.0e}")
                else:
                    cells.append(f"{path} failed")
            print(f"{name:>8} {n}x{k} M={m:<4} " + " | ".join(cells), flush=True)
        torch.cuda.empty_cache()
    layer = [s for s in ("qkv", "o", "gate_up", "down") if s in results["shapes"]]
    if len(layer) == 4:
        for m in ms:
            # (a split configuration's name holds its split, so it may be missing from other products)
            step = {path: config.num_hidden_layers * sum(results["shapes"][s][m].get(path, {}).get("us", math.nan)
                                                         for s in layer)
                    for path in results["shapes"]["qkv"][m]}
            results.setdefault("decode_step_us", {})[m] = step
            print(f"one step's layer linears, M={m}: " + ", ".join(f"{p} {us / 1000:.3f} ms" for p, us in step.items()))
    if args.sustain:
        for m in ms:
            rates = sustain_layer({s: shares[s] for s in layer}, m, args.sustain, args.tunable)
            results.setdefault("sustained_tflops", {})[m] = rates
            print(f"one layer's linears for {args.sustain:g} s, M={m}, TFLOP/s: "
                  + ", ".join(f"{p} {' / '.join(f'{r:.1f}' for r in rs)}" for p, rs in rates.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
