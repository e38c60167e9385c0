"""Where a batch-1 decode step's time goes on a GPU: host work per engine stage, and device time.

    python benchmarks/cuda_step_profile.py --model qwen3-0.6b [--attention-backend FLASHINFER] [--enforce-eager]

Runs one 128-token prompt for 256 output tokens (B2's request) after a warm-up,
timing each engine stage on the host with ``perf_counter`` and the model's
device time with CUDA events; prints one JSON line per configuration.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch


def _timed(obj, name, totals):
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t

    setattr(obj, name, wrapper)


def main() -> int:
    from dovetail import SamplingParams
    from dovetail.bench import shapes
    from dovetail.engine import llm_engine
    from dovetail.llm import LLM

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--output-len", type=int, default=256)
    args = p.parse_args()

    model_dir, defaults = shapes.materialize(args.model)
    llm = LLM(model_dir, attention_backend=args.attention_backend, enforce_eager=args.enforce_eager, **defaults)
    engine = llm.llm_engine
    prompt = list(range(1000, 1128))
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.output_len)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, ignore_eos=True, max_tokens=16),
                 use_tqdm=False)

    totals: dict[str, float] = defaultdict(float)
    _timed(engine.scheduler, "schedule", totals)
    _timed(engine.runner, "execute", totals)
    _timed(engine.outputs, "append_token", totals)
    original_sample = llm_engine.sample

    def sample(*a, **k):
        t = time.perf_counter()
        try:
            return original_sample(*a, **k)
        finally:
            totals["sample (waits for the device)"] += time.perf_counter() - t

    llm_engine.sample = sample
    device_ms = []
    model = engine.runner.model
    original_forward = model.forward

    def forward(*a, **k):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = original_forward(*a, **k)
        end.record()
        device_ms.append((start, end))
        return out

    model.forward = forward
    engine.add_request("p", {"prompt_token_ids": prompt}, params)
    steps, t0 = 0, None
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 1:  # the prefill step
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for key in list(totals):
                totals[key] = 0.0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    decode_steps = steps - 1
    graphs = engine.runner.graphs
    result = {
        "model": args.model, "attention_backend": engine.attention_backend.name,
        "cuda_graphs": graphs is not None, "decode_steps": decode_steps,
        "ms_per_step": wall / decode_steps * 1000,
        "host_ms_per_step": {k: v / decode_steps * 1000 for k, v in totals.items()},
        "eager_forward_device_ms": (sum(s.elapsed_time(e) for s, e in device_ms[1:]) / max(1, len(device_ms) - 1)
                                    if device_ms[1:] else None),
    }
    if graphs is not None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(100):
            graphs.graphs[1].replay()
        end.record()
        torch.cuda.synchronize()
        result["graph_replay_device_ms"] = start.elapsed_time(end) / 100
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
