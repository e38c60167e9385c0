"""B1's decode attention as the engine runs it: 32 layers' caches, blocks placed as the block pool places them.

``benchmarks/triton_attention.py`` times one launch on one compact cache, again and again; B1's decode steps
instead run one launch per layer, each on its own cache of the engine's size, so no launch finds its cache
blocks (or their address translations) left warm by the one before. This script times the decode launches of
whole B1 steps (``--layers`` launches captured in one CUDA graph, decodes longest first, as the TRITON backend
orders them) for:

- placement: ``presorted`` (as ``pool``, the batch's rows already longest first, so that the launch needs no
  ``decode_order``), ``pool`` (prompt blocks in request order, then each decode's new block as it fills the last, as a
  fresh pool hands them out in B1's timed run: the warm-up takes only two requests' blocks), ``shuffled``
  (the needed blocks in random order, as ``triton_attention.py`` places them);
- caches: ``layers`` (one cache per layer, each of ``--num-blocks`` blocks: the engine's size on the H200) or
  ``one`` (every launch on the same cache);
- layout: ``NHD`` (the default ``[blocks, block_size, kv_heads, head_size]``) or ``HND`` (``[blocks, kv_heads,
  block_size, head_size]``: each KV head's keys of a block contiguous), passed to the kernel as strides;
- tile configurations of the decode launch.

Each row prints the KV bytes read per second. JSON lines go to ``$OUT/attention_layers.jsonl``.

``--with-gemms`` instead asks whether the attention launches run slower between the layers' matrix products
(as in B1, where the profiler found them reading 3.5-4.0 TB/s): per step it times the 32 layers' four
projections at the step's batch alone, the attention launches alone, and both interleaved as a decode step
orders them, and sums each kind's kernel time inside the interleaved graph under the profiler. With
``--power-seconds S`` it also replays each of the three for S seconds and reports the board power and SM clock
meanwhile (B1 runs at the H200's power cap for most of its decode steps).

``--engine-path`` times B1's small-batch decode steps (the tail, 6-50 sequences) the way the engine runs
them: ``TritonAttentionImpl.forward_rotary`` per layer on a batch padded to the graph's size, for the number
of KV splits the backend chooses and for others (a split launch also stores the decodes' keys and values and
rotates them; ``fused`` says whether it did).

    cd benchmarks && python3 h200_attention_layers.py [--steps 0,300,700] [--num-blocks 50000]
        [--with-gemms | --engine-path]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random

import torch
import triton
import triton.language as tl

from h200_profile_decode import time_graph  # benchmarks/, this script's directory

from dovetail.bench.workload import random_requests
from dovetail.triton.paged_attention import LaunchConfig, default_config, paged_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, VOCAB = 32, 8, 128, 16, 128256  # llama-3.1-8b


@functools.lru_cache(maxsize=1)
def b1_requests() -> list:
    """B1's 256 requests (``dovetail bench throughput``'s draw), made once."""
    return random_requests(256, (100, 1024), (100, 1024), VOCAB, seed=0)


def b1_step(step: int) -> list[tuple[int, int, int]]:
    """(request index, prompt length, context length) of the decodes alive at B1's decode step ``step``."""
    requests = b1_requests()
    return [(i, len(r.prompt_token_ids), len(r.prompt_token_ids) + step + 1) for i, r in enumerate(requests)
            if r.output_len > step]


def pool_tables(step: int) -> list[list[int]]:
    """Block tables of the decodes alive at ``step``, numbered as a fresh FIFO pool hands blocks out in B1."""
    requests = b1_requests()
    tables, next_id = [], 0
    for r in requests:
        count = -(-len(r.prompt_token_ids) // BLOCK_SIZE)
        tables.append(list(range(next_id, next_id + count)))
        next_id += count
    for t in range(step + 1):
        for i, r in enumerate(requests):
            length = len(r.prompt_token_ids) + t + 1
            if r.output_len > t and length > len(tables[i]) * BLOCK_SIZE:
                tables[i].append(next_id)
                next_id += 1
    return [tables[i] for i, _, _ in b1_step(step)]


def shuffled_tables(step: int) -> list[list[int]]:
    needed = [-(-ctx // BLOCK_SIZE) for _, _, ctx in b1_step(step)]
    blocks = list(range(sum(needed)))
    random.Random(0).shuffle(blocks)
    return [[blocks.pop() for _ in range(n)] for n in needed]


def as_kernel_view(cache: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value caches in the kernel's ``[blocks, block_size, kv_heads, head_size]`` index order."""
    if layout == "HND":
        return cache[0].transpose(1, 2), cache[1].transpose(1, 2)
    return cache[0], cache[1]


def step_inputs(tables, contexts):
    """Block table, sequence lengths, query start offsets and longest-first order of one decode step."""
    n = len(contexts)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    query_start_loc = torch.arange(n + 1, dtype=torch.int32, device="cuda")
    order = torch.argsort(torch.tensor(contexts), descending=True, stable=True).to(torch.int32).cuda()
    return table, seq_lens, query_start_loc, order


def attention_launch(caches, layout, tables, contexts, config, ordered=True):
    """A function ``attend(layer)`` that makes that layer's decode launch of the step (its programs taking the
    sequences longest first, or with ``ordered=False`` as they come)."""
    n = len(contexts)
    table, seq_lens, query_start_loc, order = step_inputs(tables, contexts)
    q = torch.randn(n, NUM_HEADS, HEAD_SIZE, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    views = [as_kernel_view(cache, layout) for cache in caches]

    def attend(layer: int):
        key_cache, value_cache = views[layer % len(views)]
        paged_attention(q, key_cache, value_cache, out, table, seq_lens, query_start_loc, n, n,
                        HEAD_SIZE ** -0.5, decode=True, config=config, decode_order=order if ordered else None)

    return attend


def graph_ms(step, iters=10) -> float:
    """Median milliseconds of ``step()`` replayed from a CUDA graph (``iters`` replays)."""
    return time_graph(step, iters=1, repeats=iters) / 1e3


def time_step(caches, layout, tables, contexts, config, layers, iters=10, ordered=True) -> float:
    """Milliseconds of one step's ``layers`` decode launches, replayed from a CUDA graph (median)."""
    attend = attention_launch(caches, layout, tables, contexts, config, ordered)
    return graph_ms(lambda: [attend(layer) for layer in range(layers)], iters)


def with_gemms(caches, steps, layers, out_path, power_seconds: float = 0.0):
    """Attention alone, the projections alone, and both interleaved, per step (``--with-gemms``)."""
    from torch.profiler import ProfilerActivity, profile

    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down
    # As the engine's dummy weights (model_loader.fill_dummy_weights): what the tensor cores multiply sets the power.
    weights = [[torch.empty(n, k, device="cuda", dtype=torch.bfloat16).uniform_(-0.05, 0.05) for n, k in shapes]
               for _ in range(layers)]
    config = default_config(HEAD_SIZE, NUM_HEADS // NUM_KV_HEADS, True)
    for step in steps:
        contexts = [ctx for _, _, ctx in b1_step(step)]
        n = len(contexts)
        attend = attention_launch(caches, "NHD", pool_tables(step), contexts, config)
        inputs = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _, k in shapes]

        def project(layer: int, which: int):
            torch.nn.functional.linear(inputs[which], weights[layer][which])

        def gemms():
            for layer in range(layers):
                for which in range(4):
                    project(layer, which)

        def attention():
            for layer in range(layers):
                attend(layer)

        def interleaved():
            for layer in range(layers):
                project(layer, 0)
                attend(layer)
                for which in (1, 2, 3):
                    project(layer, which)

        row = {"step": step, "seqs": n, "gemms_ms": graph_ms(gemms), "attention_ms": graph_ms(attention),
               "interleaved_ms": graph_ms(interleaved)}
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            interleaved()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        row["attention_in_interleaved_ms"] = sum(e.device_time for e in kernels if "paged_attention" in e.name) / 5e3
        row["gemms_in_interleaved_ms"] = sum(e.device_time for e in kernels
                                             if "paged_attention" not in e.name) / 5e3
        nbytes = sum(contexts) * 2 * NUM_KV_HEADS * HEAD_SIZE * 2 * layers
        row["attention_alone_TBps"] = nbytes / row["attention_ms"] / 1e9
        row["attention_in_interleaved_TBps"] = nbytes / row["attention_in_interleaved_ms"] / 1e9
        if power_seconds:
            for name, fn in (("gemms", gemms), ("attention", attention), ("interleaved", interleaved)):
                row[f"{name}_power"] = under_load(fn, power_seconds)
        print(json.dumps(row), flush=True)
        with open(out_path, "a") as f:
            f.write(json.dumps({"with_gemms": True, **row}) + "\n")


def under_load(step, seconds: float) -> dict:
    """``step()`` replayed from a CUDA graph for ``seconds``: its milliseconds a replay, and the board's power
    (W) and SM clock (MHz) that ``nvidia-smi`` reports meanwhile (medians of samples every 100 ms, the first
    second left out while the power settles)."""
    import subprocess
    import threading
    import time

    samples, done = [], threading.Event()

    def poll():
        while not done.wait(0.1):
            text = subprocess.run(["nvidia-smi", "--query-gpu=power.draw.instant,clocks.sm", "--format=csv,noheader,"
                                   "nounits"], capture_output=True, text=True).stdout.split(",")
            if len(text) == 2 and time.perf_counter() - start > 1.0:
                samples.append((float(text[0]), float(text[1])))

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    poller = threading.Thread(target=poll)
    start = time.perf_counter()
    poller.start()
    replays = 0
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            graph.replay()
        replays += 20
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    done.set()
    poller.join()
    watts = sorted(w for w, _ in samples) or [float("nan")]
    clocks = sorted(c for _, c in samples) or [float("nan")]
    return {"ms": elapsed * 1e3 / replays, "watts": watts[len(watts) // 2], "sm_mhz": clocks[len(clocks) // 2],
            "samples": len(samples)}


def engine_path(caches, steps, layers, out_path, spare):
    """B1 decode steps through the TRITON backend as the engine calls it, by KV splits (``--engine-path``)."""
    from dovetail.attention.backend import AttentionLayerSpec, RotaryInputs
    from dovetail.attention.batch import AttentionBatch
    from dovetail.attention.triton_backend import TritonAttentionImpl, TritonBackend, TritonMetadataBuilder
    from dovetail.engine.model_runner import graph_batch_sizes
    from dovetail.layers.rotary import compute_cos_sin_cache
    from dovetail.triton import paged_attention as kernel_module

    spec = AttentionLayerSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5)
    impl = TritonAttentionImpl(spec)
    cos_sin = compute_cos_sin_cache(HEAD_SIZE, 8192, {"rope_theta": 500000.0, "rope_type": "default"}, 8192).cuda()
    chosen_splits = kernel_module.default_num_splits
    for step in steps:
        contexts = [ctx for _, _, ctx in b1_step(step)]
        n = len(contexts)
        size = next(s for s in graph_batch_sizes(256) if s >= n)
        tables = pool_tables(step) + [[spare]] * (size - n)
        plain = AttentionBatch.from_lists([1] * size, contexts + [1] * (size - n), tables, BLOCK_SIZE, "cuda")
        batch = TritonMetadataBuilder(TritonBackend, [spec], BLOCK_SIZE, torch.device("cuda"),
                                      torch.bfloat16).build_for_graph(plain, size)
        positions = (plain.seq_lens - 1).long()
        rotary = RotaryInputs(positions, cos_sin, HEAD_SIZE, None)
        qkv = torch.randn(size, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE, device="cuda", dtype=torch.bfloat16)
        q, k, v = (t.view(size, -1, HEAD_SIZE) for t in qkv.split(
            [NUM_HEADS * HEAD_SIZE, NUM_KV_HEADS * HEAD_SIZE, NUM_KV_HEADS * HEAD_SIZE], dim=1))
        nbytes = sum(contexts) * 2 * NUM_KV_HEADS * HEAD_SIZE * 2 * layers
        default = chosen_splits(size, NUM_KV_HEADS, q.device)
        for splits in sorted({default, 1, 2, 4, 8, 16}):
            kernel_module.default_num_splits = lambda *_, splits=splits: splits
            try:
                ms = graph_ms(lambda: [impl.forward_rotary(q, k, v, caches[layer % len(caches)], batch, rotary)
                                       for layer in range(layers)])
                fused = impl._fuses_into_decode_launch(size, q)
            finally:
                kernel_module.default_num_splits = chosen_splits
            row = {"engine_path": True, "step": step, "seqs": n, "graph_size": size, "splits": splits,
                   "default": splits == default, "fused": fused, "ms": ms, "TBps": nbytes / ms / 1e9}
            print(f"step {step:4} {n:3} seqs (graph {size:3}) splits {splits:2}{' (default)' if row['default'] else '':10}"
                  f" fused={fused!s:5}: {ms:7.3f} ms {row['TBps']:5.2f} TB/s", flush=True)
            with open(out_path, "a") as f:
                f.write(json.dumps(row) + "\n")


@triton.jit
def _read_kernel(x_ptr, out_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * CHUNK
    total = tl.zeros([BLOCK], tl.float32)
    for offset in range(0, CHUNK, BLOCK):
        total += tl.load(x_ptr + base + offset + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(total, 0))


def read_bandwidth(power_seconds: float = 0.0) -> float:
    """Bytes/s of reading 4 GiB once with wide loads and no writes to speak of (a Triton sum per 64 KiB), the
    bound for a kernel that only reads; the copy bandwidth of BENCHMARKS.md counts a read and a write. With
    ``power_seconds``, also prints the power and SM clock while the fastest configuration runs that long."""
    x = torch.randn(1 << 31, dtype=torch.bfloat16, device="cuda")
    best, best_read = 0.0, None
    for chunk, block, warps in ((32768, 2048, 4), (32768, 4096, 8), (131072, 4096, 8), (8192, 2048, 4)):
        out = torch.empty(x.numel() // chunk, dtype=torch.float32, device="cuda")

        def read(out=out, chunk=chunk, block=block, warps=warps):
            _read_kernel[(out.numel(),)](x, out, CHUNK=chunk, BLOCK=block, num_warps=warps)

        rate = x.numel() * 2 / graph_ms(read) / 1e9
        if rate > best:
            best, best_read = rate, read
    if power_seconds:
        load = under_load(best_read, power_seconds)
        print(f"read-only kernel under load: {x.numel() * 2 / load['ms'] / 1e9:.2f} TB/s, {load}", flush=True)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default="0,300,700")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=50000)
    parser.add_argument("--with-gemms", action="store_true")
    parser.add_argument("--engine-path", action="store_true")
    parser.add_argument("--power-seconds", type=float, default=0.0,
                        help="with --with-gemms: also replay each kind for this long, sampling power and SM clock")
    parser.add_argument("--configs", default="64,4,2;64,4,3;128,8,2;64,8,3;32,4,4",
                        help="tile configurations besides the default: TILE_N,WARPS,STAGES;...")
    parser.add_argument("--layouts", default="NHD,HND")
    parser.add_argument("--quick", action="store_true", help="only pool placement over the layers' caches")
    args = parser.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    out_path = os.path.join(os.environ.get("OUT", "/tmp/out"), "attention_layers.jsonl")
    shape = {"NHD": (2, args.num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE),
             "HND": (2, args.num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE)}
    print(f"read-only bandwidth {read_bandwidth(args.power_seconds):.2f} TB/s", flush=True)
    default = default_config(HEAD_SIZE, NUM_HEADS // NUM_KV_HEADS, True)
    configs = [default] + [LaunchConfig(default.block_m, *map(int, c.split(",")), True)
                           for c in args.configs.split(";") if c]
    if args.with_gemms or args.engine_path:
        caches = [torch.empty(shape["NHD"], dtype=torch.bfloat16, device="cuda") for _ in range(args.layers)]
        for cache in caches:
            cache[:, :25000].normal_()
        if args.engine_path:
            return engine_path(caches, steps, args.layers, out_path, args.num_blocks - 1)
        return with_gemms(caches, steps, args.layers, out_path, args.power_seconds)
    for layout in args.layouts.split(","):
        caches = [torch.empty(shape[layout], dtype=torch.bfloat16, device="cuda") for _ in range(args.layers)]
        for cache in caches:
            cache[:, :25000].normal_()
        for step in steps:
            contexts = [ctx for _, _, ctx in b1_step(step)]
            nbytes = sum(contexts) * 2 * NUM_KV_HEADS * HEAD_SIZE * 2 * args.layers
            pool = pool_tables(step)
            by_length = sorted(range(len(contexts)), key=lambda i: -contexts[i])
            placements = [("pool", pool, contexts), ("presorted", [pool[i] for i in by_length],
                                                     [contexts[i] for i in by_length])]
            if not args.quick:
                placements.append(("shuffled", shuffled_tables(step), contexts))
            for placement, tables, lengths in placements:
                for where in ("layers",) if args.quick else ("layers", "one"):
                    for config in configs if placement == "pool" and where == "layers" else configs[:1]:
                        ms = time_step(caches if where == "layers" else caches[:1], layout, tables, lengths,
                                       config, args.layers, ordered=placement != "presorted")
                        row = {"layout": layout, "step": step, "seqs": len(contexts), "placement": placement,
                               "caches": where, "config": config.__dict__, "ms": ms,
                               "TBps": nbytes / ms / 1e9}
                        print(f"{layout} step {step:4} ({len(contexts):3} seqs) {placement:8} {where:6} "
                              f"tile {config.tile_n:3} w{config.num_warps} s{config.num_stages}: "
                              f"{ms:7.3f} ms {row['TBps']:5.2f} TB/s", flush=True)
                        with open(out_path, "a") as f:
                            f.write(json.dumps(row) + "\n")
        del caches
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
