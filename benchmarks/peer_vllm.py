"""vLLM, the serving peer, on B1 and B2 of a named shape with the same requests as ``dovetail bench``.

    python benchmarks/peer_vllm.py --model llama-3.1-8b [--tensor-parallel-size 2] [--skip-b1] [--skip-b2]

Needs vLLM installed (it is not a dependency of Dovetail). The shape is written as a config-only model
directory and loaded with ``load_format="dummy"`` and no tokenizer (``skip_tokenizer_init``), as Dovetail's
benchmarks load it; ``max_model_len=4096`` and ``gpu_memory_utilization=0.85`` as docs/benchmarks.md asks. B1:
the 256 requests of ``dovetail.bench.workload.b1_requests``, greedy, ``ignore_eos``, timed over one
``generate`` after a warm-up on other prompts. B2: one 128-token prompt, milliseconds per output token with
prefill excluded (a 256-token run less a 1-token run). ``llm_seconds`` is the time to build vLLM's engine.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--skip-b1", action="store_true")
    p.add_argument("--skip-b2", action="store_true")
    args = p.parse_args()

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from dovetail.bench import shapes
    from dovetail.bench.workload import b1_requests, random_requests

    model_dir, defaults = shapes.materialize(args.model)
    vocab_size = shapes.SHAPES[args.model].config().vocab_size
    t0 = time.perf_counter()
    llm = LLM(model=model_dir, load_format="dummy", dtype=defaults["dtype"], skip_tokenizer_init=True,
              max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
              tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager, seed=0)
    result = {"model": args.model, "peer": "vllm", "vllm": vllm.__version__, "tensor_parallel_size":
              args.tensor_parallel_size, "llm_seconds": time.perf_counter() - t0}

    def run(prompts: list[list[int]], lengths: list[int]) -> float:
        params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=n, detokenize=False) for n in lengths]
        start = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert [len(o.outputs[0].token_ids) for o in outputs] == lengths
        return elapsed

    if not args.skip_b2:
        prompt = random_requests(1, (128, 128), (1, 1), vocab_size, 0)[0].prompt_token_ids
        run([prompt[::-1]], [8])  # warm-up
        first = min(run([prompt], [1]) for _ in range(2))
        full = min(run([prompt], [256]) for _ in range(2))
        result["B2"] = {"ms_per_token": (full - first) / 255 * 1000, "prefill_ms": first * 1000}
    if not args.skip_b1:
        requests = b1_requests(vocab_size)
        run([r.prompt_token_ids[::-1] for r in requests[:2]], [r.output_len for r in requests[:2]])  # warm-up
        seconds = run([r.prompt_token_ids for r in requests], [r.output_len for r in requests])
        tokens = sum(r.output_len for r in requests)
        result["B1"] = {"output_tokens": tokens, "seconds": seconds, "output_tokens_per_s": tokens / seconds}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
