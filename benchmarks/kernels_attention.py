"""TRITON attention and fused ops on a GPU, against REFERENCE and torch's SDPA, in one run.

For the attention shapes of ``--models`` (default qwen3-0.6b: 16 heads, 8 KV heads, head 128, and
llama-3.1-8b: 32 heads, 8 KV heads; also one rank's shape at TP=2 and qwen3-moe's 4 KV heads: ``MODELS``),
bf16, block size 16, it times one
layer's attention call (KV write included) for:

- decode at batch 1 (context 128, 1024, 8192) and at batch 64 and 256 (context 1024);
- prefill of one 1024- and one 4096-token prompt, and of four 512-token prompts;
- a mixed chunked-prefill step: 128 decodes (context 1000) and a 512-token chunk after 512 cached tokens.

Peers in the same run: ``REFERENCE`` (the core's torch oracle) and, where the
batch is uniform, ``torch.nn.functional.scaled_dot_product_attention`` on
contiguous (not paged) keys and values, which uses FlashAttention-2 or the
memory-efficient kernel. TRITON is also timed replayed from a CUDA graph (how the
engine runs decode). Decode rows report the KV bytes read per second and that as a
fraction of the device-to-device copy bandwidth measured at the start; prefill
rows report TFLOP/s. Each row also prints TRITON's largest difference from REFERENCE.

``--sweep`` times tile configurations (``LaunchConfig``) and KV splits of the
kernel alone for a few scenarios and prints the fastest, to tune
``default_config`` / ``default_num_splits``. ``--sweep-decode`` does the same for decode-only
launches shaped like B1's (192 sequences, contexts 100-2048) for each model, with the bandwidth
each configuration reaches, and only that; ``--sweep-prefill`` for prefill-only launches like B1's
first steps (28 prompts of 100-1024 tokens), with TFLOP/s; ``--sweep-splits`` KV splits of decode batches of
8-192 long sequences (B1's last steps); ``--sweep-order`` 256 B1-like decodes by the order of their programs;
``--sweep-layout`` the same launches by the cache's block size, and one compact layer against the engine's layout
(one cache per layer, blocks spread over each); ``--sweep-lengths`` the engine's decode launches at 64-256
sequences of one context length and of lengths spread over 100-2048 (longest first) with the same mean, and of
twice that length: whether a launch loses its bandwidth to unequal lengths (its programs ending at different
times) or to what every launch costs.

Usage::

    python benchmarks/kernels_attention.py [--models qwen3-0.6b,llama-3.1-8b,qwen3-moe-15b-a3b] [--dtype bfloat16]
        [--iters 50] [--sweep] [--sweep-decode] [--sweep-prefill] [--sweep-splits] [--sweep-order]
        [--sweep-lengths] [--sweep-layout [--layers 32] [--cache-gb 48]] [--skip-fused]
        [--json results.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import subprocess
from datetime import date, datetime, timezone

import torch

#: (query heads, KV heads, head size) of one rank's attention. Four KV heads a rank is what qwen3-moe-15b-a3b has,
#: and what llama-3.1-8b and qwen3-32b leave each of two tensor-parallel ranks.
MODELS = {"qwen3-0.6b": (16, 8, 128), "llama-3.1-8b": (32, 8, 128), "qwen3-moe-15b-a3b": (32, 4, 128),
          "llama-3.1-8b-tp2": (16, 4, 128), "qwen3-32b-tp2": (32, 4, 128)}
DEFAULT_MODELS = "qwen3-0.6b,llama-3.1-8b"
BLOCK_SIZE = 16
DEVICE = "cuda"


def scenarios() -> dict[str, list[tuple[int, int]]]:
    """Name -> per sequence (tokens already cached, new tokens)."""
    rng = random.Random(0)
    return {
        "decode b1 ctx128": [(127, 1)],
        "decode b1 ctx1024": [(1023, 1)],
        "decode b1 ctx8192": [(8191, 1)],
        "decode b64 ctx1024": [(1023, 1)] * 64,
        "decode b256 ctx1024": [(1023, 1)] * 256,
        "decode b256 ctx100-2048": [(rng.randint(100, 2048), 1) for _ in range(256)],
        "prefill 1x1024": [(0, 1024)],
        "prefill 1x4096": [(0, 4096)],
        "prefill 4x512": [(0, 512)] * 4,
        "mixed 128 dec + 512 chunk": [(1000, 1)] * 128 + [(512, 512)],
    }


def make_inputs(seqs, num_heads, num_kv_heads, head_size, dtype, seed=0):
    from dovetail.attention.batch import AttentionBatch

    rng = random.Random(seed)
    needed = [-(-(c + n) // BLOCK_SIZE) for c, n in seqs]
    blocks = list(range(sum(needed) + 1))
    rng.shuffle(blocks)
    tables = [[blocks.pop() for _ in range(n)] for n in needed]
    batch = AttentionBatch.from_lists([n for _, n in seqs], [c + n for c, n in seqs], tables, BLOCK_SIZE, DEVICE)
    tokens = batch.num_tokens
    q = torch.randn(tokens, num_heads, head_size, device=DEVICE, dtype=dtype)
    k = torch.randn(tokens, num_kv_heads, head_size, device=DEVICE, dtype=dtype)
    v = torch.randn(tokens, num_kv_heads, head_size, device=DEVICE, dtype=dtype)
    cache = torch.randn(2, sum(needed) + 1, BLOCK_SIZE, num_kv_heads, head_size, device=DEVICE, dtype=dtype)
    return q, k, v, cache, batch


def time_ms(fn, iters: int, warmup: int = 5) -> float:
    """Median milliseconds per call, by CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def graphed(fn):
    """``fn`` captured in a CUDA graph; returns the replay function."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), 1 GiB buffers."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), 20)
    return 2 * src.numel() / (ms / 1e3)


def sdpa_peer(seqs, num_heads, num_kv_heads, head_size, dtype):
    """SDPA on contiguous K/V for uniform batches (all decodes of one length, or all full prefills)."""
    lens = {(c, n) for c, n in seqs}
    if len(lens) != 1:
        return None
    (cached, new), batch = next(iter(lens)), len(seqs)
    if new != 1 and cached != 0:
        return None
    total = cached + new
    qs = torch.randn(batch, num_heads, new, head_size, device=DEVICE, dtype=dtype)
    ks = torch.randn(batch, num_kv_heads, total, head_size, device=DEVICE, dtype=dtype)
    vs = torch.randn_like(ks)
    causal = new > 1
    fn = torch.nn.functional.scaled_dot_product_attention
    return lambda: fn(qs, ks, vs, is_causal=causal, enable_gqa=num_heads != num_kv_heads)


def shapes(models: list[str]):
    return [(model, MODELS[model]) for model in models]


def kv_bytes(seqs, num_kv_heads, head_size, dtype) -> int:
    element = torch.tensor([], dtype=dtype).element_size()
    return sum(c + n for c, n in seqs) * 2 * num_kv_heads * head_size * element


def attention_flops(seqs, num_heads, head_size) -> float:
    visible = sum(sum(c + i + 1 for i in range(n)) for c, n in seqs)
    return 4.0 * num_heads * head_size * visible


def bench_attention(models, dtype, iters, bandwidth):
    from dovetail.attention.backend import AttentionLayerSpec
    from dovetail.attention.reference import ReferenceAttentionImpl
    from dovetail.attention.triton_backend import TritonAttentionImpl, TritonBackend, TritonMetadataBuilder

    rows = []
    for model in models:
        num_heads, num_kv_heads, head_size = MODELS[model]
        spec = AttentionLayerSpec(num_heads, num_kv_heads, head_size, head_size ** -0.5)
        triton_impl, reference = TritonAttentionImpl(spec), ReferenceAttentionImpl(spec)
        for name, seqs in scenarios().items():
            seqs = sorted(seqs, key=lambda s: s[1] != 1)
            q, k, v, cache, plain = make_inputs(seqs, num_heads, num_kv_heads, head_size, dtype)
            batch = TritonMetadataBuilder(TritonBackend, [spec], BLOCK_SIZE, torch.device(DEVICE), dtype).build(plain)
            ref_out = reference.forward(q, k, v, cache.clone(), plain)
            tri_out = triton_impl.forward(q, k, v, cache, batch)
            diff = (tri_out.float() - ref_out.float()).abs().max().item()
            row = {"model": model, "scenario": name, "max_abs_diff_vs_reference": diff}
            row["triton_ms"] = time_ms(lambda: triton_impl.forward(q, k, v, cache, batch), iters)
            if batch.max_query_len == 1:
                row["triton_graph_ms"] = time_ms(graphed(lambda: triton_impl.forward(q, k, v, cache, batch)), iters)
            row["reference_ms"] = time_ms(lambda: reference.forward(q, k, v, cache, batch), max(5, iters // 5))
            peer = sdpa_peer(seqs, num_heads, num_kv_heads, head_size, dtype)
            row["sdpa_contiguous_ms"] = time_ms(peer, iters) if peer else None
            best = row.get("triton_graph_ms") or row["triton_ms"]
            if batch.max_query_len == 1:
                rate = kv_bytes(seqs, num_kv_heads, head_size, dtype) / (best / 1e3)
                row["kv_read_GBps"] = rate / 1e9
                row["fraction_of_copy_bandwidth"] = rate / bandwidth
            else:
                row["TFLOPs"] = attention_flops(seqs, num_heads, head_size) / (best / 1e3) / 1e12
            rows.append(row)
            print(format_row(row), flush=True)
            del q, k, v, cache, batch, ref_out, tri_out
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    return rows


def format_row(row) -> str:
    def ms(key):
        value = row.get(key)
        return f"{value:9.4f}" if value is not None else "        -"

    extra = (f"{row['kv_read_GBps']:7.0f} GB/s ({row['fraction_of_copy_bandwidth']:.0%} of copy)"
             if "kv_read_GBps" in row else f"{row['TFLOPs']:7.1f} TFLOP/s")
    return (f"{row['model']:13} {row['scenario']:27} triton {ms('triton_ms')}  graph {ms('triton_graph_ms')}  "
            f"reference {ms('reference_ms')}  sdpa {ms('sdpa_contiguous_ms')} ms  {extra}  "
            f"diff {row['max_abs_diff_vs_reference']:.2e}")


def bench_fused(dtype, iters, token_counts=(1, 256, 8192)):
    from dovetail.layers.rotary import compute_cos_sin_cache
    from dovetail.ops import FusedOps
    from dovetail.triton.fused_ops import TritonFusedOps

    torch_ops, triton_ops = FusedOps(), TritonFusedOps()
    params = {"rope_theta": 500000.0, "rope_type": "default"}
    cos_sin = compute_cos_sin_cache(128, 16384, params, 16384).to(DEVICE)
    rows = []
    for tokens in token_counts:
        x = torch.randn(tokens, 4096, device=DEVICE, dtype=dtype)
        residual, weight = torch.randn_like(x), torch.randn(4096, device=DEVICE, dtype=dtype)
        gate_up = torch.randn(tokens, 2 * 14336, device=DEVICE, dtype=dtype)
        qkv = torch.randn(tokens, 48 * 128, device=DEVICE, dtype=dtype)
        q, k = qkv[:, :4096], qkv[:, 4096:5120]
        positions = torch.randint(0, 16384, (tokens,), device=DEVICE)
        cases = {
            "add_rms_norm 4096": lambda ops: ops.add_rms_norm(x, residual, weight, 1e-5),
            "silu_and_mul 14336": lambda ops: ops.silu_and_mul(gate_up),
            "rotary 32q+8kv x128": lambda ops: ops.rotary_embedding(positions, q, k, cos_sin, 128, 128),
        }
        for name, call in cases.items():
            row = {"op": name, "tokens": tokens,
                   "triton_ms": time_ms(lambda: call(triton_ops), iters),
                   "torch_ms": time_ms(lambda: call(torch_ops), iters)}
            rows.append(row)
            print(f"{name:22} tokens {tokens:5}  triton {row['triton_ms']:8.4f} ms  torch {row['torch_ms']:8.4f} ms  "
                  f"speed-up {row['torch_ms'] / row['triton_ms']:5.2f}x", flush=True)
    return rows


def sweep(dtype, iters):
    """Time the kernel alone (no KV write) over tile configurations and KV splits."""
    from dovetail.triton.paged_attention import LaunchConfig, paged_attention

    num_heads, num_kv_heads, head_size = MODELS["llama-3.1-8b"]
    chosen = {name: seqs for name, seqs in scenarios().items()
              if name in ("decode b1 ctx8192", "decode b256 ctx1024", "prefill 1x4096", "decode b1 ctx1024")}
    results = []
    for name, seqs in chosen.items():
        q, k, v, cache, batch = make_inputs(seqs, num_heads, num_kv_heads, head_size, dtype)
        out = torch.empty_like(q)
        decode = batch.max_query_len == 1
        timings = []
        block_ms = (16, 32) if decode else (64, 128)
        splits = (1, 2, 4, 8, 16, 32) if decode else (1,)
        for block_m, tile_n, warps, stages, num_splits in itertools.product(
                block_ms, (32, 64, 128), (4, 8), (2, 3), splits):
            cfg = LaunchConfig(block_m, tile_n, warps, stages)

            def call():
                paged_attention(q, cache[0], cache[1], out, batch.block_table, batch.seq_lens,
                                batch.query_start_loc, batch.num_tokens, batch.num_seqs, head_size ** -0.5,
                                decode=decode, num_splits=num_splits, config=cfg)
            try:
                timings.append((time_ms(call, iters, warmup=2), cfg, num_splits))
            except Exception as exc:  # out of shared memory or registers for this tile
                print(f"  {name}: {cfg} splits={num_splits} failed: {type(exc).__name__}", flush=True)
        timings.sort(key=lambda t: t[0])
        for ms, cfg, num_splits in timings[:5]:
            print(f"sweep {name:22} {ms:8.4f} ms  {cfg}  splits={num_splits}", flush=True)
            results.append({"scenario": name, "ms": ms, "config": cfg.__dict__, "splits": num_splits})
    return results


def sweep_decode(dtype, iters, models):
    """Decode-only launches like B1's, each of the models: every tile configuration and 1 or 2 KV splits."""
    from dovetail.triton.paged_attention import LaunchConfig, default_config, paged_attention

    rng = random.Random(1)
    seqs = [(rng.randint(100, 2048), 1) for _ in range(192)]
    results = []
    for model, (num_heads, num_kv_heads, head_size) in shapes(models):
        q, k, v, cache, batch = make_inputs(seqs, num_heads, num_kv_heads, head_size, dtype)
        out = torch.empty_like(q)
        nbytes = kv_bytes(seqs, num_kv_heads, head_size, dtype)
        default = default_config(head_size, num_heads // num_kv_heads, True, dtype)
        timings = []
        for tile_n, warps, stages, num_splits in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4), (1, 2)):
            cfg = LaunchConfig(default.block_m, tile_n, warps, stages, default.heads_fastest)

            def call():
                paged_attention(q, cache[0], cache[1], out, batch.block_table, batch.seq_lens,
                                batch.query_start_loc, batch.num_tokens, batch.num_seqs, head_size ** -0.5,
                                decode=True, num_splits=num_splits, config=cfg)
            try:
                ms = time_ms(call, iters, warmup=2)
            except Exception as exc:  # out of shared memory or registers for this tile
                print(f"  {model}: {cfg} splits={num_splits} failed: {type(exc).__name__}", flush=True)
                continue
            timings.append((ms, cfg, num_splits))
            results.append({"model": model, "ms": ms, "TBps": nbytes / ms / 1e9, "config": cfg.__dict__,
                            "splits": num_splits, "default": cfg == default and num_splits == 1})
        timings.sort(key=lambda t: t[0])
        for ms, cfg, num_splits in timings[:6] + [t for t in timings if t[1] == default and t[2] == 1]:
            print(f"sweep-decode {model:13} {ms:8.4f} ms {nbytes / ms / 1e9:5.2f} TB/s  {cfg}  splits={num_splits}"
                  f"{'  (default)' if cfg == default and num_splits == 1 else ''}", flush=True)
    return results


def sweep_order(dtype, iters, models, batch_size=256):
    """B1-like decode launches (contexts 100-2048) in the order drawn or longest first, the programs numbered
    KV head by KV head or sequence by sequence, with 64 or 128 keys a step: KV bytes/s from CUDA-graph replays."""
    from dovetail.triton.paged_attention import LaunchConfig, default_config, paged_attention

    rng = random.Random(2)
    drawn = [(rng.randint(100, 2048), 1) for _ in range(batch_size)]
    results = []
    for model, (num_heads, num_kv_heads, head_size) in shapes(models):
        default = default_config(head_size, num_heads // num_kv_heads, True, dtype)
        for order, seqs in (("drawn", drawn), ("longest first", sorted(drawn, reverse=True))):
            q, k, v, cache, batch = make_inputs(seqs, num_heads, num_kv_heads, head_size, dtype)
            out = torch.empty_like(q)
            nbytes = kv_bytes(seqs, num_kv_heads, head_size, dtype)
            for tile_n, stages, heads_fastest in itertools.product((64, 128), (2, 3), (False, True)):
                cfg = LaunchConfig(default.block_m, tile_n, default.num_warps, stages, heads_fastest)

                def call():
                    for _ in range(10):
                        paged_attention(q, cache[0], cache[1], out, batch.block_table, batch.seq_lens,
                                        batch.query_start_loc, batch.num_tokens, batch.num_seqs, head_size ** -0.5,
                                        decode=True, config=cfg)
                try:
                    ms = time_ms(graphed(call), iters, warmup=2) / 10
                except Exception as exc:  # out of shared memory for this tile
                    print(f"  {model}: {cfg} failed: {type(exc).__name__}", flush=True)
                    continue
                results.append({"model": model, "order": order, "ms": ms, "TBps": nbytes / ms / 1e9,
                                "config": cfg.__dict__})
                print(f"sweep-order {model:13} {order:13} {ms:8.4f} ms {nbytes / ms / 1e9:5.2f} TB/s  {cfg}", flush=True)
    return results


def sweep_splits(dtype, iters, models):
    """Decode-only launches of 8-192 sequences with long contexts (500-2048, as B1's last steps), each model:
    KV splits 1-16 with the default tiles, the bandwidth each reaches, against ``default_num_splits``."""
    from dovetail.triton.paged_attention import default_num_splits, paged_attention

    results = []
    for model, (num_heads, num_kv_heads, head_size) in shapes(models):
        for batch_size in (8, 16, 32, 64, 128, 192):
            rng = random.Random(batch_size)
            seqs = [(rng.randint(500, 2048), 1) for _ in range(batch_size)]
            q, k, v, cache, batch = make_inputs(seqs, num_heads, num_kv_heads, head_size, dtype)
            out = torch.empty_like(q)
            nbytes = kv_bytes(seqs, num_kv_heads, head_size, dtype)
            chosen = default_num_splits(batch_size, num_kv_heads, q.device)
            timings = {}
            for num_splits in (1, 2, 4, 8, 16):
                def call():
                    paged_attention(q, cache[0], cache[1], out, batch.block_table, batch.seq_lens,
                                    batch.query_start_loc, batch.num_tokens, batch.num_seqs, head_size ** -0.5,
                                    decode=True, num_splits=num_splits)
                timings[num_splits] = time_ms(graphed(call), iters, warmup=2)
            best = min(timings, key=timings.get)
            row = {"model": model, "batch": batch_size, "default_splits": chosen, "best_splits": best,
                   "ms": timings, "TBps": {n: nbytes / ms / 1e9 for n, ms in timings.items()}}
            results.append(row)
            print(f"sweep-splits {model:13} batch {batch_size:4} default {chosen:2} ({row['TBps'][chosen]:4.2f} TB/s) "
                  f"best {best:2} ({row['TBps'][best]:4.2f} TB/s) | "
                  + " ".join(f"{n}:{t:.2f}" for n, t in row["TBps"].items()), flush=True)
    return results


def decode_figures(seqs, shape, dtype, iters, splits_list) -> dict:
    """µs and KV bytes/s of the decode launch over ``seqs`` at each KV split count of ``splits_list`` (one layer's
    ``shape``: heads, KV heads, head size), from CUDA-graph replays of ten launches; the inputs made once."""
    from dovetail.triton.paged_attention import paged_attention

    num_heads, num_kv_heads, head_size = shape
    q, k, v, cache, batch = make_inputs(seqs, num_heads, num_kv_heads, head_size, dtype)
    out = torch.empty_like(q)
    nbytes = kv_bytes(seqs, num_kv_heads, head_size, dtype)
    figures = {}
    for num_splits in splits_list:
        def call():
            for _ in range(10):
                paged_attention(q, cache[0], cache[1], out, batch.block_table, batch.seq_lens,
                                batch.query_start_loc, batch.num_tokens, batch.num_seqs, head_size ** -0.5,
                                decode=True, num_splits=num_splits)
        ms = time_ms(graphed(call), iters, warmup=2) / 10
        figures[num_splits] = {"us": ms * 1e3, "TBps": nbytes / ms / 1e9}
    return figures


def sweep_layout(dtype, iters, models, layers: int, cache_gb: float, batch_size=256):
    """256 B1-like decodes (contexts 100-2048, longest first), the default launch, against the cache's layout:
    block sizes 16, 32 and 64; one layer's compact cache (the batch's blocks only, shuffled, the launch repeated)
    against ``layers`` such caches, the launches walking layer after layer, and against ``layers`` caches of
    ``cache_gb / layers`` GB each, as the engine allocates them, the batch's blocks drawn from the whole of each:
    whether the change of layer or the spread costs bandwidth (the engine's decode attention reads its cache
    slower than one repeated launch does)."""
    from dovetail.attention.batch import AttentionBatch
    from dovetail.triton.paged_attention import paged_attention

    rng = random.Random(2)
    seqs = sorted(((rng.randint(100, 2048), 1) for _ in range(batch_size)), reverse=True)
    results = []
    for model, (num_heads, num_kv_heads, head_size) in shapes(models):
        nbytes = kv_bytes(seqs, num_kv_heads, head_size, dtype)
        for block_size, (count, spread) in itertools.product((16, 32, 64), ((1, False), (layers, False),
                                                                             (layers, True))):
            needed = [-(-(c + n) // block_size) for c, n in seqs]
            block_bytes = 2 * block_size * num_kv_heads * head_size * torch.tensor([], dtype=dtype).element_size()
            num_blocks = max(int(cache_gb * 1e9 / layers / block_bytes), sum(needed)) if spread else sum(needed) + 1
            blocks = random.Random(3).sample(range(num_blocks), sum(needed))
            tables = [[blocks.pop() for _ in range(n)] for n in needed]
            batch = AttentionBatch.from_lists([n for _, n in seqs], [c + n for c, n in seqs], tables, block_size,
                                              DEVICE)
            q = torch.randn(batch.num_tokens, num_heads, head_size, device=DEVICE, dtype=dtype)
            out = torch.empty_like(q)
            caches = [torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, device=DEVICE, dtype=dtype)
                      for _ in range(count)]
            calls = max(count, 10)

            def call():
                for i in range(calls):
                    cache = caches[i % count]
                    paged_attention(q, cache[0], cache[1], out, batch.block_table, batch.seq_lens,
                                    batch.query_start_loc, batch.num_tokens, batch.num_seqs, head_size ** -0.5,
                                    decode=True)
            ms = time_ms(graphed(call), iters, warmup=2) / calls
            layout = (f"{count} layers of {num_blocks * block_bytes / 1e9:.2f} GB" if spread
                      else f"{count} compact layer{'s' if count > 1 else ''}")
            results.append({"model": model, "block_size": block_size, "layout": layout, "ms": ms,
                            "TBps": nbytes / ms / 1e9})
            print(f"sweep-layout {model:13} block {block_size:3} {layout:26} {ms:8.4f} ms "
                  f"{nbytes / ms / 1e9:5.2f} TB/s", flush=True)
            del caches, q, out, batch
            torch.cuda.empty_cache()
    return results


def sweep_lengths(dtype, iters, models):
    """The engine's decode launches (default tiles and splits) of 64-256 sequences: contexts spread over 100-2048
    (longest first, as the engine orders them), all of their mean length, and all twice that; KV bytes/s of each,
    and the launch time that bytes do not explain (``fixed_us``: the intercept through the two uniform lengths);
    the spread lengths also with 2 and 4 KV splits (``spread_splits``)."""
    from dovetail.triton.paged_attention import default_num_splits

    results = []
    for model, shape in shapes(models):
        for batch_size in (64, 80, 96, 112, 128, 160, 192, 256):
            rng = random.Random(batch_size)
            spread = sorted(((rng.randint(100, 2048), 1) for _ in range(batch_size)), reverse=True)
            mean = round(sum(c for c, _ in spread) / batch_size)
            default = default_num_splits(batch_size, shape[1], torch.device(DEVICE))
            row = {"model": model, "batch": batch_size, "mean_context": mean, "splits": default}
            spread_figures = decode_figures(spread, shape, dtype, iters, list(dict.fromkeys([default, 2, 4])))
            row["spread"] = spread_figures[default]
            row["spread_splits"] = {n: spread_figures[n] for n in (2, 4)}
            row["uniform"] = decode_figures([(mean, 1)] * batch_size, shape, dtype, iters, [default])[default]
            row["uniform_x2"] = decode_figures([(2 * mean, 1)] * batch_size, shape, dtype, iters, [default])[default]
            row["fixed_us"] = 2 * row["uniform"]["us"] - row["uniform_x2"]["us"]
            results.append(row)
            print(f"sweep-lengths {model:17} batch {batch_size:3} mean {mean:4} splits {row['splits']:2} | "
                  + " ".join(f"{n} {row[n]['us']:7.1f} us {row[n]['TBps']:4.2f} TB/s |"
                             for n in ("spread", "uniform", "uniform_x2"))
                  + f" fixed {row['fixed_us']:5.1f} us | spread with splits "
                  + " ".join(f"{n}: {f['TBps']:4.2f}" for n, f in row["spread_splits"].items()), flush=True)
    return results


def sweep_prefill(dtype, iters, models):
    """Prefill-only launches like B1's first steps (prompts of 100-1024 tokens, ~16k tokens), each model:
    every tile configuration, with the TFLOP/s each reaches."""
    from dovetail.triton.paged_attention import LaunchConfig, default_config, paged_attention

    rng = random.Random(2)
    seqs = [(0, rng.randint(100, 1024)) for _ in range(28)]
    results = []
    for model, (num_heads, num_kv_heads, head_size) in shapes(models):
        q, k, v, cache, batch = make_inputs(seqs, num_heads, num_kv_heads, head_size, dtype)
        out = torch.empty_like(q)
        flops = attention_flops(seqs, num_heads, head_size)
        default = default_config(head_size, num_heads // num_kv_heads, False, dtype)
        timings = []
        for block_m, tile_n, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
            cfg = LaunchConfig(block_m, tile_n, warps, stages)

            def call():
                paged_attention(q, cache[0], cache[1], out, batch.block_table, batch.seq_lens,
                                batch.query_start_loc, batch.num_tokens, batch.num_seqs, head_size ** -0.5,
                                decode=False, config=cfg)
            try:
                ms = time_ms(call, iters, warmup=2)
            except Exception as exc:  # out of shared memory or registers for this tile
                print(f"  {model}: {cfg} failed: {type(exc).__name__}", flush=True)
                continue
            timings.append((ms, cfg))
            results.append({"model": model, "ms": ms, "TFLOPs": flops / ms / 1e9, "config": cfg.__dict__,
                            "default": cfg == default})
        timings.sort(key=lambda t: t[0])
        for ms, cfg in timings[:6] + [t for t in timings if t[1] == default]:
            print(f"sweep-prefill {model:13} {ms:8.4f} ms {flops / ms / 1e9:6.1f} TFLOP/s  {cfg}"
                  f"{'  (default)' if cfg == default else ''}", flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help=f"attention shapes among {', '.join(MODELS)}")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-decode", action="store_true", help="only sweep B1-like decode launches")
    parser.add_argument("--sweep-prefill", action="store_true", help="only sweep B1-like prefill launches")
    parser.add_argument("--sweep-splits", action="store_true", help="only sweep KV splits of mid-size decode batches")
    parser.add_argument("--sweep-order", action="store_true", help="only B1-like decode launches by program order")
    parser.add_argument("--sweep-lengths", action="store_true",
                        help="only decode launches of spread against uniform context lengths")
    parser.add_argument("--sweep-layout", action="store_true",
                        help="only B1-like decode launches by block size and by how the cache is laid out")
    parser.add_argument("--layers", type=int, default=32, help="--sweep-layout: the caches the launches walk")
    parser.add_argument("--cache-gb", type=float, default=48.0, help="--sweep-layout: their size together")
    parser.add_argument("--skip-fused", action="store_true")
    parser.add_argument("--json", default=None, help="write all results to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA (or ROCm) GPU")
    import triton

    dtype = getattr(torch, args.dtype)
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"--models: unknown {', '.join(unknown)}; choose among {', '.join(MODELS)}")
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    meta = {"date": date.today().isoformat(), "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": commit, "dtype": args.dtype, "copy_bandwidth_TBps": bandwidth / 1e12}
    print(json.dumps(meta), flush=True)
    if args.sweep_decode or args.sweep_prefill or args.sweep_splits or args.sweep_order or args.sweep_lengths\
            or args.sweep_layout:
        results = {"meta": meta}
        if args.sweep_layout:
            results["sweep_layout"] = sweep_layout(dtype, max(10, args.iters // 5), models, args.layers,
                                                   args.cache_gb)
        if args.sweep_lengths:
            results["sweep_lengths"] = sweep_lengths(dtype, max(10, args.iters // 5), models)
        if args.sweep_order:
            results["sweep_order"] = sweep_order(dtype, max(10, args.iters // 5), models)
        if args.sweep_splits:
            results["sweep_splits"] = sweep_splits(dtype, max(10, args.iters // 5), models)
        if args.sweep_decode:
            results["sweep_decode"] = sweep_decode(dtype, max(10, args.iters // 5), models)
        if args.sweep_prefill:
            results["sweep_prefill"] = sweep_prefill(dtype, max(10, args.iters // 5), models)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return
    results = {"meta": meta,
               "attention": bench_attention(args.models.split(","), dtype, args.iters, bandwidth)}
    if not args.skip_fused:
        results["fused_ops"] = bench_fused(dtype, args.iters)
    if args.sweep:
        results["sweep"] = sweep(dtype, max(10, args.iters // 5))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
