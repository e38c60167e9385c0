"""Where an engine step's time goes on a GPU: host time per engine stage, and the kernels of a decode step.

    python benchmarks/cuda_step_profile.py --model qwen3-0.6b [--attention-backend FLASHINFER]
        [--enforce-eager] [--workload b2|b1] [--kernels]

``b2`` runs B2's request (a 128-token prompt, 256 output tokens) after a warm-up;
``b1`` runs B1's 256 requests. Each engine stage is timed on the host with
``perf_counter``, separately for decode-only steps and for steps with prefill
tokens; ``sample`` includes the wait for the device. ``--kernels`` adds the ten
costliest kernels of a batch-1 decode step (torch.profiler). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections import defaultdict

import torch


class StageTimers:
    """Wraps engine methods to add their host time to the current step's kind."""

    def __init__(self):
        self.kind = "decode"
        self.totals = {"decode": defaultdict(float), "prefill": defaultdict(float)}
        self.steps = {"decode": 0, "prefill": 0}

    def wrap(self, obj, name, label=None):
        original = getattr(obj, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[self.kind][label or name] += time.perf_counter() - t

        setattr(obj, name, wrapper)

    def report(self):
        return {kind: {"steps": self.steps[kind],
                       **{k: round(v / max(1, self.steps[kind]) * 1000, 4) for k, v in self.totals[kind].items()}}
                for kind in self.totals}


def profile_steps(engine, timers: StageTimers) -> float:
    """Step until done; classify each step by the batch the scheduler forms. Returns the wall seconds."""
    schedule = engine.scheduler.schedule

    def classified():
        batch = schedule()
        timers.kind = "decode" if batch and all(n == 1 for n in batch.num_new_tokens) else "prefill"
        timers.steps[timers.kind] += 1
        return batch

    engine.scheduler.schedule = classified
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        timers.totals[timers.kind]["step"] += time.perf_counter() - t
    torch.cuda.synchronize()
    engine.scheduler.schedule = schedule
    return time.perf_counter() - t0


def top_kernels(fn, repeats: int = 20, top: int = 10) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us:
            rows.append({"kernel": event.key[:90], "calls_per_step": event.count / repeats,
                         "us_per_step": round(device_us / repeats, 2)})
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    return [{"total_us_per_step": round(total, 1), "kernels": len(rows)}] + rows[:top]


def main() -> int:
    from dovetail import SamplingParams
    from dovetail.bench import shapes
    from dovetail.bench.workload import random_requests
    from dovetail.engine import llm_engine
    from dovetail.llm import LLM

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--workload", choices=("b1", "b2"), default="b2")
    p.add_argument("--kernels", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    model_dir, defaults = shapes.materialize(args.model)
    llm = LLM(model_dir, attention_backend=args.attention_backend, enforce_eager=args.enforce_eager or None,
              **defaults)
    engine = llm.llm_engine
    llm.generate([{"prompt_token_ids": list(range(1000, 1128))}],
                 SamplingParams(temperature=0, ignore_eos=True, max_tokens=16), use_tqdm=False)
    if args.workload == "b2":
        requests = [(list(range(1000, 1128)), 256)]
    else:
        requests = [(r.prompt_token_ids, r.output_len)
                    for r in random_requests(256, (100, 1024), (100, 1024), engine.vocab_size, 0)]
    for i, (prompt, n) in enumerate(requests):
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, ignore_eos=True, max_tokens=n))

    timers = StageTimers()
    timers.wrap(engine.runner, "execute")
    timers.wrap(engine.kv_manager, "block_ids")
    timers.wrap(engine.outputs, "append_token")
    timers.wrap(llm_engine, "sample", "sample (waits for the device)")
    graphs = engine.runner.graphs
    if graphs is not None:
        timers.wrap(graphs, "_load", "execute: graph inputs")
        timers.wrap(engine.runner.metadata_builder, "build_for_graph", "execute: attention plan")
        for graph in graphs.graphs.values():
            timers.wrap(graph, "replay", "execute: graph launch")
    timers.wrap(engine.runner.model, "compute_logits", "execute: logits launch")
    wall = profile_steps(engine, timers)
    out_tokens = sum(n for _, n in requests)
    result = {"model": args.model, "workload": args.workload, "attention_backend": engine.attention_backend.name,
              "cuda_graphs": engine.runner.graphs is not None, "wall_s": round(wall, 3),
              "output_tokens_per_s": round(out_tokens / wall, 1), "host_ms_per_step": timers.report()}
    if args.workload == "b2":
        result["ms_per_decode_step"] = round(result["host_ms_per_step"]["decode"]["step"], 4)
    if args.kernels:
        graphs = engine.runner.graphs
        if graphs is not None:
            result["graph_replay_batch1"] = top_kernels(graphs.graphs[1].replay)
        else:
            from dovetail.engine.scheduler import ScheduledBatch

            engine.add_request("k", {"prompt_token_ids": list(range(1000, 1120))},
                               SamplingParams(temperature=0, ignore_eos=True, max_tokens=4))
            engine.step()
            req = engine._requests["k"]
            tables = [engine.kv_manager.block_ids("k")]
            result["eager_decode_batch1"] = top_kernels(
                lambda: engine.runner.execute(ScheduledBatch([req], [1]), tables))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
