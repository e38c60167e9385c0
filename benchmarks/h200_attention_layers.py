"""B1's decode attention as the engine runs it: 32 layers' caches, blocks placed as the block pool places them.

``benchmarks/triton_attention.py`` times one launch on one compact cache, again and again; B1's decode steps
instead run one launch per layer, each on its own cache of the engine's size, so no launch finds its cache
blocks (or their address translations) left warm by the one before. This script times the decode launches of
whole B1 steps (``--layers`` launches captured in one CUDA graph, decodes longest first, as the TRITON backend
orders them) for:

- placement: ``pool`` (prompt blocks in request order, then each decode's new block as it fills the last, as a
  fresh pool hands them out in B1's timed run: the warm-up takes only two requests' blocks), ``shuffled``
  (the needed blocks in random order, as ``triton_attention.py`` places them);
- caches: ``layers`` (one cache per layer, each of ``--num-blocks`` blocks: the engine's size on the H200) or
  ``one`` (every launch on the same cache);
- layout: ``NHD`` (the default ``[blocks, block_size, kv_heads, head_size]``) or ``HND`` (``[blocks, kv_heads,
  block_size, head_size]``: each KV head's keys of a block contiguous), passed to the kernel as strides;
- tile configurations of the decode launch.

Each row prints the KV bytes read per second. JSON lines go to ``$OUT/attention_layers.jsonl``.

    python3 benchmarks/h200_attention_layers.py [--steps 0,300,700] [--num-blocks 50000]
"""

from __future__ import annotations

import argparse
import json
import os
import random

import torch

from dovetail.bench.workload import random_requests
from dovetail.triton.paged_attention import LaunchConfig, default_config, paged_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, VOCAB = 32, 8, 128, 16, 128256  # llama-3.1-8b


def b1_step(step: int) -> list[tuple[int, int, int]]:
    """(request index, prompt length, context length) of the decodes alive at B1's decode step ``step``."""
    requests = random_requests(256, (100, 1024), (100, 1024), VOCAB, seed=0)
    return [(i, len(r.prompt_token_ids), len(r.prompt_token_ids) + step + 1) for i, r in enumerate(requests)
            if r.output_len > step]


def pool_tables(step: int) -> list[list[int]]:
    """Block tables of the decodes alive at ``step``, numbered as a fresh FIFO pool hands blocks out in B1."""
    requests = random_requests(256, (100, 1024), (100, 1024), VOCAB, seed=0)
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


def time_step(caches, layout, tables, contexts, config, layers, iters=10) -> float:
    """Milliseconds of one step's ``layers`` decode launches, replayed from a CUDA graph (median)."""
    n = len(contexts)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    query_start_loc = torch.arange(n + 1, dtype=torch.int32, device="cuda")
    order = torch.argsort(torch.tensor(contexts), descending=True, stable=True).to(torch.int32).cuda()
    q = torch.randn(n, NUM_HEADS, HEAD_SIZE, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    views = [as_kernel_view(caches[i % len(caches)], layout) for i in range(layers)]

    def step():
        for key_cache, value_cache in views:
            paged_attention(q, key_cache, value_cache, out, table, seq_lens, query_start_loc, n, n,
                            HEAD_SIZE ** -0.5, decode=True, config=config, decode_order=order)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[iters // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default="0,300,700")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=50000)
    args = parser.parse_args()
    out_path = os.path.join(os.environ.get("OUT", "/tmp/out"), "attention_layers.jsonl")
    shape = {"NHD": (2, args.num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE),
             "HND": (2, args.num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE)}
    default = default_config(HEAD_SIZE, NUM_HEADS // NUM_KV_HEADS, True)
    configs = [default] + [LaunchConfig(default.block_m, tile, warps, stages, True)
                           for tile, warps, stages in ((64, 4, 2), (64, 4, 3), (128, 8, 2), (64, 8, 3), (32, 4, 4))]
    for layout in ("NHD", "HND"):
        caches = [torch.empty(shape[layout], dtype=torch.bfloat16, device="cuda") for _ in range(args.layers)]
        for cache in caches:
            cache[:, :25000].normal_()
        for step in (int(s) for s in args.steps.split(",")):
            contexts = [ctx for _, _, ctx in b1_step(step)]
            nbytes = sum(contexts) * 2 * NUM_KV_HEADS * HEAD_SIZE * 2 * args.layers
            for placement, tables in (("pool", pool_tables(step)), ("shuffled", shuffled_tables(step))):
                for where in ("layers", "one"):
                    for config in configs if placement == "pool" and where == "layers" else configs[:1]:
                        ms = time_step(caches if where == "layers" else caches[:1], layout, tables, contexts,
                                       config, args.layers)
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
