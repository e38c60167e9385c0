"""Where the engine's time goes on the CPU, on the C1 model (see cpu_c1c2.py): a wall-clock breakdown.

Wraps (in this process only) the engine's stages and the model's layers with timers, runs a C1-like
workload (or a batch-1 decode, ``--c2``), and prints the seconds and share of each part:

- engine stages: schedule, prepare inputs (runner.prepare), model forward, logits (lm_head),
  sampling, output processing; the rest of ``LLMEngine.step`` is reported as "other";
- inside the forward: linear layers (torch matmuls), attention backend, fused ops, embedding, rest.

Usage::

    python benchmarks/cpu_engine_profile.py [--backend CPU_SIMD] [--threads N] [--num-requests 32] [--c2 | --c1-like]
"""

from __future__ import annotations

import argparse
import collections
import functools
import random
import time

import torch

from cpu_c1c2 import build_model, c1_like_requests, c1_requests

TIMES: dict[str, float] = collections.defaultdict(float)
CALLS: dict[str, int] = collections.defaultdict(int)
_stack: list[str] = []


def timed(name: str, fn):
    """``fn`` that adds its own wall time to ``name`` (excluding nested timed calls)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        _stack.append(name)
        try:
            return fn(*args, **kwargs)
        finally:
            _stack.pop()
            elapsed = time.perf_counter() - start
            TIMES[name] += elapsed
            CALLS[name] += 1
            if _stack:
                TIMES[_stack[-1]] -= elapsed

    return wrapper


def instrument(llm) -> None:
    engine = llm.llm_engine
    import dovetail.engine.llm_engine as llm_engine_module
    from dovetail.layers.attention import Attention
    from dovetail.layers.embedding import VocabEmbedding
    from dovetail.layers.linear import Linear

    engine.step = timed("engine.step (other)", engine.step)
    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    engine.runner.prepare = timed("runner.prepare", engine.runner.prepare)
    engine.runner.run_model = timed("forward (other)", engine.runner.run_model)
    engine.model.compute_logits = timed("compute_logits (lm_head)", engine.model.compute_logits)
    engine.outputs.append_token = timed("output processing", engine.outputs.append_token)
    for name in ("sample", "launch_sample"):  # the sampler's entry point, whichever the engine calls
        if hasattr(llm_engine_module, name):
            setattr(llm_engine_module, name, timed("sample", getattr(llm_engine_module, name)))
    ops = None
    for module in engine.model.modules():
        if isinstance(module, Linear):
            module.forward = timed("linear", module.forward)
        elif isinstance(module, Attention):
            module.impl.forward = timed(f"attention ({engine.attention_backend.name})", module.impl.forward)
        elif isinstance(module, VocabEmbedding):
            module.forward = timed("embedding", module.forward)
        if hasattr(module, "ops"):
            ops = module.ops
    for name in ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary_embedding"):
        setattr(ops, name, timed(f"fused op {name} ({ops.name})", getattr(ops, name)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default="/tmp/dovetail-c1-model")
    parser.add_argument("--backend", default="CPU_SIMD")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--c2", action="store_true", help="one 128-token prompt, 256 output tokens")
    parser.add_argument("--c1-like", action="store_true", help="32 x (160 prompt + 96 output), llama.cpp's C1-like run")
    args = parser.parse_args()
    from dovetail import LLM, SamplingParams

    path = build_model(__import__("pathlib").Path(args.model_dir))
    llm = LLM(str(path), attention_backend=args.backend, cpu_threads=args.threads, max_model_len=2048)
    if args.c2:
        requests = [(random.Random(1).sample(range(2, 32000), 128), 256)]
    elif args.c1_like:
        requests = c1_like_requests()
    else:
        requests = c1_requests(args.num_requests)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)
    instrument(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    steps = CALLS["engine.step (other)"]
    accounted = sum(TIMES.values())
    TIMES["outside engine.step"] = total - accounted
    print(f"{tokens} output tokens in {total:.2f}s ({tokens / total:.1f} tok/s), {steps} steps "
          f"({total / steps * 1000:.2f} ms/step), {torch.get_num_threads()} threads, backend {args.backend}")
    for name, seconds in sorted(TIMES.items(), key=lambda kv: -kv[1]):
        calls = CALLS.get(name, 0)
        per = f", {seconds / calls * 1e6:.0f} us/call x {calls}" if calls else ""
        print(f"  {name:<40} {seconds:8.3f}s {seconds / total * 100:5.1f}%{per}")


if __name__ == "__main__":
    main()
