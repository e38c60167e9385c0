"""HF transformers ``generate``, the everyday peer: B1 and B2 of a named shape, loaded once.

    python benchmarks/peer_hf.py --model llama-3.1-8b [--b1-prompts 64] [--device cuda]

Random weights are drawn directly on the device (as with Dovetail's dummy weights, their values do not
change the speed), in the shape's dtype. B1 runs the first ``--b1-prompts`` of B1's 256 requests
(docs/benchmarks.md; all of them by default) in left-padded batches of ``--batch-size``; B2 is ``dovetail
bench latency``'s prompt. Prints one JSON line; ``dovetail bench throughput|latency --compare-hf`` runs the
same peer after the engine in one process.
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
    from dovetail.bench.workload import b1_requests, random_requests

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-0.6b", choices=sorted(shapes.SHAPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--b1-prompts", type=int, default=256, help="how many of B1's requests (0: skip B1)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--skip-b2", action="store_true")
    args = p.parse_args()

    shape = shapes.SHAPES[args.model]
    config = shape.config()
    t0 = time.perf_counter()
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, shape.dtype)).eval()
    result = {"model": args.model, "peer": "hf-transformers", "device": args.device,
              "load_seconds": time.perf_counter() - t0}
    if not args.skip_b2:
        b2_prompt = random_requests(1, (128, 128), (1, 1), config.vocab_size, 0)[0].prompt_token_ids
        result["B2"] = hf_latency(model, b2_prompt, 256, args.device)
    if args.b1_prompts:
        requests = b1_requests(config.vocab_size)[:args.b1_prompts]
        hf_throughput(model, requests[:2], 2, args.device)  # warm-up
        result["B1"] = {**hf_throughput(model, requests, args.batch_size, args.device), "requests": len(requests)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
