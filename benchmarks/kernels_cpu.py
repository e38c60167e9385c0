"""Micro-benchmarks of the CPU plugin's kernels against the core's torch definitions, same shapes, same run.

- attention: CPU_SIMD (KV-cache write + paged attention, one call) against REFERENCE on the C1 model's
  attention (8 heads, 4 KV heads, head 64, block 16): a decode batch, prefills, a mixed batch, and one
  long decode; float32 and bfloat16.
- fused ops: RMSNorm with residual add, NeoX rotary, SiLU-and-mul (``CpuFusedOps``) against
  ``dovetail.ops.FusedOps`` at 1, 32 and 2048 tokens of the C1 shapes (hidden 512, intermediate 1376).
- linear (the C++ kernel behind ``CpuFusedOps.linear``) against ``F.linear`` on the C1 model's weights
  (QKV, gate/up, down, LM head) at 1 to 256 rows: where it wins sets ``CpuFusedOps.LINEAR_MAX_ROWS``.
- ``--decode-pass``: only one batch-1 pass over every linear weight of the C1 model (8 layers and the LM
  head, 158 MB in float32, what a C2 decode step reads), through each ``--isa`` in interleaved rounds and
  through ``F.linear``: milliseconds per pass and the bandwidth it reached.

Prints one line per case: median and best microseconds of each, and the speed-up (median). Usage::

    python benchmarks/kernels_cpu.py [--isa auto|avx512_bf16|avx512|avx2|portable ...] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from dovetail.attention.backend import AttentionLayerSpec
from dovetail.attention.batch import AttentionBatch
from dovetail.attention.reference import ReferenceAttentionImpl
from dovetail.ops import FusedOps
from dovetail_cpu import isa
from dovetail_cpu.attention import CpuSimdImpl, build_metadata
from dovetail_cpu.ops import CpuFusedOps


def timed(fn, min_time: float = 0.3, max_runs: int = 2000) -> tuple[float, float]:
    """(median, best) seconds of ``fn()`` over repeated runs after a warm-up."""
    fn()
    times = []
    start = time.perf_counter()
    while (time.perf_counter() - start < min_time or len(times) < 5) and len(times) < max_runs:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def attention_case(name, seqs, dtype, heads=8, kv_heads=4, head_size=64, block_size=16, seed=0):
    rng = random.Random(seed)
    seqs = sorted(seqs, key=lambda s: s[1] != 1)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 1
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in seqs]
    batch = AttentionBatch.from_lists([n for _, n in seqs], [c + n for c, n in seqs], tables, block_size)
    tokens = batch.num_tokens
    q = torch.randn(tokens, heads, head_size).to(dtype)
    k = torch.randn(tokens, kv_heads, head_size).to(dtype)
    v = torch.randn(tokens, kv_heads, head_size).to(dtype)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_size).to(dtype)
    spec = AttentionLayerSpec(heads, kv_heads, head_size, head_size ** -0.5)
    ref, ours = ReferenceAttentionImpl(spec), CpuSimdImpl(spec)
    ref_t = timed(lambda: ref.forward(q, k, v, cache, batch))
    ours_t = timed(lambda: ours.forward(q, k, v, cache, build_metadata(batch)))
    return name, ref_t, ours_t


def attention_cases(dtype):
    rng = random.Random(0)
    decode32 = [(rng.randint(64, 384), 1) for _ in range(32)]
    return [
        attention_case("decode 32 seqs, context 64-384", decode32, dtype),
        attention_case("prefill 4 x 160 tokens", [(0, 160)] * 4, dtype),
        attention_case("prefill 1 x 2048 tokens", [(0, 2048)], dtype),
        attention_case("mixed 16 decodes + 2 chunks of 256", decode32[:16] + [(256, 256), (0, 256)], dtype),
        attention_case("decode 1 seq, context 4096", [(4095, 1)], dtype),
    ]


def ops_cases(dtype):
    torch_ops, ours = FusedOps(), CpuFusedOps()
    hidden, inter, heads, kv_heads, head = 512, 1376, 8, 4, 64
    cache = torch.randn(4096, head)
    results = []
    for tokens in (1, 32, 2048):
        x, res, w = (torch.randn(tokens, hidden).to(dtype), torch.randn(tokens, hidden).to(dtype),
                     torch.randn(hidden).to(dtype))
        gate_up = torch.randn(tokens, 2 * inter).to(dtype)
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head).to(dtype)
        q, k, _ = qkv.split([heads * head, kv_heads * head, kv_heads * head], dim=-1)
        pos = torch.randint(0, 4096, (tokens,))
        for name, fn in (
            ("add_rms_norm", lambda o: o.add_rms_norm(x, res, w, 1e-6)),
            ("rms_norm", lambda o: o.rms_norm(x, w, 1e-6)),
            ("rotary_embedding", lambda o: o.rotary_embedding(pos, q, k, cache, head, head)),
            ("silu_and_mul", lambda o: o.silu_and_mul(gate_up)),
        ):
            results.append((f"{name} {tokens} tokens", timed(lambda: fn(torch_ops)), timed(lambda: fn(ours))))
    return results


def linear_cases(dtype):
    from dovetail_cpu import kernels

    results = []
    for name, (n, k) in {"qkv 1024x512": (1024, 512), "gate_up 2752x512": (2752, 512),
                         "down 512x1376": (512, 1376), "lm_head 32000x512": (32000, 512)}.items():
        w = torch.randn(n, k).to(dtype)
        for rows in (1, 4, 16, 32, 64, 128, 256):
            x = torch.randn(rows, k).to(dtype)
            threads = torch.get_num_threads()
            results.append((f"{name}, {rows} rows", timed(lambda: torch.nn.functional.linear(x, w)),
                            timed(lambda: kernels.linear(x, w, None, threads))))
    return results


def decode_pass(isas: list[str], rounds: int = 5) -> None:
    """Time batch-1 passes over the C1 model's linear weights per ISA, interleaved so that all see the same noise."""
    from dovetail_cpu import kernels

    shapes = [(1024, 512), (512, 512), (2752, 512), (512, 1376)] * 8 + [(32000, 512)]
    weights = [torch.randn(n, k) for n, k in shapes]
    inputs = {k: torch.randn(1, k) for k in (512, 1376)}
    total = sum(w.numel() * w.element_size() for w in weights)
    threads = torch.get_num_threads()

    def kernel_pass():
        for w in weights:
            kernels.linear(inputs[w.shape[1]], w, None, threads)

    def torch_pass():
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)

    results: dict[str, list[float]] = {}
    for _ in range(rounds):
        for path in isas:
            chosen = isa.select_isa(path)
            results.setdefault(chosen, []).append(timed(kernel_pass, min_time=0.2)[0])
        results.setdefault("torch F.linear", []).append(timed(torch_pass, min_time=0.2)[0])
    for name, times in results.items():
        med = statistics.median(times)
        print(f"decode pass ({total / 1e6:.0f} MB, {threads}t) {name}: {med * 1e3:.2f} ms (rounds "
              f"{', '.join(f'{t * 1e3:.2f}' for t in times)}), {total / med / 1e9:.1f} GB/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", nargs="*", default=["auto"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument("--skip-ops", action="store_true")
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument("--skip-linear", action="store_true")
    parser.add_argument("--decode-pass", action="store_true", help="only time batch-1 passes over the C1 weights")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.decode_pass:
        decode_pass(args.isa)
        return
    rows = []
    for path in args.isa:
        chosen = isa.select_isa(path)
        for dtype_name in args.dtype:
            dtype = getattr(torch, dtype_name)
            cases = [] if args.skip_attention else [("attention",) + c for c in attention_cases(dtype)]
            cases += [] if args.skip_ops else [("fused op",) + c for c in ops_cases(dtype)]
            cases += [] if args.skip_linear else [("linear",) + c for c in linear_cases(dtype)]
            for kind, name, (ref_med, ref_best), (our_med, our_best) in cases:
                label = "REFERENCE" if kind == "attention" else "torch"
                print(f"[{chosen} {dtype_name} {torch.get_num_threads()}t] {kind} {name}: {label} "
                      f"{ref_med * 1e6:.0f} us (best {ref_best * 1e6:.0f}), CPU_SIMD {our_med * 1e6:.0f} us "
                      f"(best {our_best * 1e6:.0f}), x{ref_med / our_med:.1f}", flush=True)
                rows.append(dict(isa=chosen, dtype=dtype_name, kind=kind, case=name, torch_us=ref_med * 1e6,
                                 ours_us=our_med * 1e6))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
