"""HF transformers ``generate`` on B1 and B2 of a named shape, loaded once (the peer of the GPU benchmarks).

    python benchmarks/cuda_hf_peer.py --model llama-3.1-8b [--b1-prompts 64]

Random bf16 weights are initialised directly on the GPU (as with Dovetail's
dummy weights, their values do not change the speed). B1 runs the first
``--b1-prompts`` requests of the same seeded workload as ``dovetail bench
throughput`` in padded batches of 64; B2 is ``dovetail bench latency``'s prompt.
Both use :mod:`dovetail.bench.hf_peer`. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> int:
    from transformers import AutoModelForCausalLM

    from dovetail.bench import shapes
    from dovetail.bench.hf_peer import hf_latency, hf_throughput
    from dovetail.bench.workload import random_requests

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--b1-prompts", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args()

    config = shapes.SHAPES[args.model].config()
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    load_s = time.perf_counter() - t0
    vocab = config.vocab_size
    b2_prompt = random_requests(1, (128, 128), (1, 1), vocab, 0)[0].prompt_token_ids
    b2 = hf_latency(model, b2_prompt, 256, "cuda")
    requests = random_requests(256, (100, 1024), (100, 1024), vocab, 0)[:args.b1_prompts]
    hf_throughput(model, requests[:2], 2, "cuda")  # warm-up
    b1 = hf_throughput(model, requests, args.batch_size, "cuda")
    print(json.dumps({"model": args.model, "peer": "hf-transformers", "load_seconds": load_s,
                      "B2": b2, "B1": {**b1, "requests": len(requests)}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
