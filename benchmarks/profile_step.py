"""Where a decode step spends its time: kernel by kernel on the device, and stage by stage on the host.

    python benchmarks/profile_step.py --model llama-3.1-8b [--quantization fp8] [--attention-backend TRITON]
    python benchmarks/profile_step.py --model qwen3-0.6b --b1 64
    python benchmarks/profile_step.py --model c1 --device cpu --stages [--b1 32]
    python benchmarks/profile_step.py --trace DIR/rank0.*.pt.trace.json.gz

Kernels (the default): the engine runs eagerly (graphs change the gaps between launches, not the kernels'
durations) under ``torch.profiler``, on the device's activity (CUDA on GPUs, the CPU's operators otherwise).
One request of 128 prompt tokens is generated twice, with 1 and with 65 output tokens; the difference of each
kernel's total time, divided by 64, is its cost per decode step (prefill and start-up cancel out).
``--b1 N`` instead profiles the first N of B1's requests (docs/benchmarks.md) in one ``generate`` and sums
the kernels by group (attention, matrix products, norms/rotary/activation/KV write, other) against the wall
time. With ``--prefill-only`` each request generates one token, so every step is a prefill step, and the
matrix products' rate is printed in TFLOP/s (the layers' products' FLOPs over the group's time, which holds
the LM head's few rows too; dense models only), to set beside ``kernels_linear.py --sustain`` on the same
card: the products as the engine's prefill runs them against the same products back to back.

``--trace FILE`` reads a trace that ``dovetail bench ... --profile`` wrote (one per rank, under
``DOVETAIL_TORCH_PROFILER_DIR``; a whole B1 as the engine runs it, graphs included) instead of running a model:
the device's busy share of the span, each kernel's summed time and the groups' (and the groups' outside graph
replays: the eager steps, which at B1 are the prefill steps), the idle time by the
length of the gap it fell in, the short gaps' idle time by the kernels on either side, the time between one
graph replay and the next (where a decode step's inputs are copied), and the longest gaps with the kernels on
either side and the host's longest calls meanwhile. With programmatic
dependent launch a kernel starts before its predecessor ends and waits, so a short kernel's time there
includes some of the one before it.

``--stages`` times the host instead: each engine stage (schedule, prepare, forward, logits, output
processing) and, inside the forward, the linear layers, the attention backend and the embedding, by wrapping
those public methods in this process; with the engine's graphs on unless ``--enforce-eager``.

Prints a table; writes JSON to ``--json`` if given.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import functools
import json
import statistics
import time

import torch

#: Kernel-name substrings of each group that ``--b1`` sums.
KERNEL_GROUPS = {"attention": ("paged_attention", "reduce_splits", "flashinfer", "flash_fwd", "BatchDecode",
                               "BatchPrefill", "attention"),
                 "matmul": ("nvjet", "gemm", "cutlass", "splitKreduce", "gemv", "sm90_xmma", "cublas", "aten::mm",
                            "aten::addmm", "aten::linear", "dt_linear"),
                 "norm, rotary, activation, KV write": ("rms_norm", "rotary", "act_and_mul", "kv_cache_write",
                                                        "fused")}


def group_of(kernel: str) -> str:
    """The :data:`KERNEL_GROUPS` group a kernel name falls in, else ``"other"``."""
    return next((g for g, keys in KERNEL_GROUPS.items() if any(key in kernel for key in keys)), "other")


def on_gpu(llm) -> bool:
    return llm.llm_engine.device.type != "cpu"


def synchronize(llm) -> None:
    if on_gpu(llm):
        torch.accelerator.synchronize()


def profiled(llm, fn) -> dict[str, tuple[float, int]]:
    """Microseconds and calls per kernel (operator, on the CPU) of ``fn()``."""
    from torch.profiler import ProfilerActivity, profile

    gpu = on_gpu(llm)
    with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        fn()
        synchronize(llm)
    totals: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.key_averages():
        us = event.self_device_time_total if gpu else event.self_cpu_time_total
        if us > 0:
            totals[event.key][0] += us
            totals[event.key][1] += event.count
    return {k: (v[0], v[1]) for k, v in totals.items()}


def decode_step_kernels(llm) -> dict:
    from dovetail.sampling_params import SamplingParams

    prompt = [{"prompt_token_ids": list(range(1000, 1128))}]

    def run(tokens: int):
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)

    run(8)
    one, many = profiled(llm, lambda: run(1)), profiled(llm, lambda: run(65))
    per_step = {}
    for name in set(one) | set(many):
        (t65, c65), (t1, c1) = many.get(name, (0.0, 0)), one.get(name, (0.0, 0))
        per_step[name] = {"us": (t65 - t1) / 64, "calls": (c65 - c1) / 64}
    ranked = sorted(per_step.items(), key=lambda kv: -kv[1]["us"])
    return {"us_per_step": sum(v["us"] for _, v in ranked),
            "kernels": [{"name": k[:140], **v} for k, v in ranked if abs(v["us"]) > 0.05]}


def layer_product_flops_per_token(model_dir: str) -> int:
    """FLOPs of the layers' matrix products (qkv, o, gate/up, down) for one token of a dense model."""
    from transformers import AutoConfig

    from dovetail.bench.shapes import projections

    config = AutoConfig.from_pretrained(model_dir)
    shapes = projections(config)
    if "router" in shapes:
        raise SystemExit(f"--prefill-only counts a dense model's products; {model_dir} routes to experts")
    return 2 * config.num_hidden_layers * sum(n * k for name, (n, k) in shapes.items()
                                              if name in ("qkv", "o", "gate_up", "down"))


def b1_kernels(llm, num: int, prefill_only: bool = False) -> dict:
    from dovetail.bench.workload import b1_requests, greedy_inputs, warm_up

    requests = b1_requests(llm.llm_engine.vocab_size)[:num]
    if prefill_only:
        for request in requests:
            request.output_len = 1
    prompts, params = greedy_inputs(requests)
    warm_up(llm, prompts, params)
    start = time.perf_counter()
    kernels = profiled(llm, lambda: llm.generate(prompts, params, use_tqdm=False))
    wall = time.perf_counter() - start
    groups: dict[str, float] = collections.defaultdict(float)
    for name, (us, _) in kernels.items():
        groups[group_of(name)] += us / 1e6
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    return {"requests": num, "wall_s": wall, "output_tokens": sum(r.output_len for r in requests),
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
            "kernel_s": sum(us for us, _ in kernels.values()) / 1e6, "groups_s": dict(groups),
            "kernels": [{"name": k[:140], "s": us / 1e6, "calls": c} for k, (us, c) in ranked[:40]]}


class StageTimers:
    """Wall time of wrapped callables, each excluding the wrapped calls nested in it."""

    def __init__(self):
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self.stack: list[str] = []

    def wrap(self, owner, attribute: str, label: str) -> None:
        fn = getattr(owner, attribute, None)
        if fn is None:
            return

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            self.stack.append(label)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()
                elapsed = time.perf_counter() - start
                self.seconds[label] += elapsed
                self.calls[label] += 1
                if self.stack:
                    self.seconds[self.stack[-1]] -= elapsed

        setattr(owner, attribute, timed)


def host_stages(llm, num: int) -> dict:
    from dovetail.bench.workload import b1_requests, greedy_inputs, random_requests, warm_up
    from dovetail.layers.attention import Attention
    from dovetail.layers.embedding import VocabEmbedding
    from dovetail.layers.linear import Linear

    engine = llm.llm_engine
    if num:
        requests = b1_requests(engine.vocab_size)[:num]
    else:
        requests = random_requests(1, (128, 128), (256, 256), engine.vocab_size)
    prompts, params = greedy_inputs(requests)
    warm_up(llm, prompts, params)
    timers = StageTimers()
    timers.wrap(engine, "step", "engine step (rest)")
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine.outputs, "append_token", "output processing")
    runner = getattr(engine, "runner", None)
    if runner is not None:
        timers.wrap(runner, "prepare", "prepare inputs")
        timers.wrap(runner, "run_model", "forward (rest)")
        timers.wrap(runner.model, "compute_logits", "logits")
    for module in engine.model.modules():
        if isinstance(module, Linear):
            timers.wrap(module, "forward", "linear layers")
        elif isinstance(module, Attention):
            timers.wrap(module.impl, "forward", f"attention ({engine.attention_backend.name})")
        elif isinstance(module, VocabEmbedding):
            timers.wrap(module, "forward", "embedding")
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    synchronize(llm)
    wall = time.perf_counter() - start
    timers.seconds["outside the engine step"] = wall - sum(timers.seconds.values())
    return {"requests": len(requests), "wall_s": wall, "output_tokens": sum(r.output_len for r in requests),
            "steps": timers.calls["engine step (rest)"],
            "stages": [{"stage": k, "s": v, "calls": timers.calls.get(k, 0)}
                       for k, v in sorted(timers.seconds.items(), key=lambda kv: -kv[1])]}


#: Upper ends of the idle-gap classes of ``--trace`` (µs).
GAP_CLASSES = (5, 20, 100, 1000, float("inf"))
#: Trace categories of the host's side: the operators, the runtime's calls and the engine's annotations.
HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")


def trace_summary(path: str) -> dict:
    """Device time in a Chrome trace: span, busy time, kernels by name and group, idle time by gap length."""
    import gzip

    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        trace_events = json.load(f)["traceEvents"]
    events = [e for e in trace_events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    host_events = sorted((e for e in trace_events if e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES),
                         key=lambda e: e["ts"])
    host_starts = [e["ts"] for e in host_events]
    if not events:
        raise SystemExit(f"{path}: no device events (was the trace recorded with the device's activity?)")
    events.sort(key=lambda e: e["ts"])
    start = events[0]["ts"]
    end = max(e["ts"] + e["dur"] for e in events)
    busy, covered, last, idle = 0.0, None, None, collections.Counter()
    idle_between = collections.Counter()  # (kernel that ended, kernel that started) -> idle µs of gaps under 20 µs
    long_gaps = []  # (gap µs, start, kernel that ended, kernel that started)
    for e in events:
        if covered is not None and e["ts"] > covered:
            gap = e["ts"] - covered
            idle[next(limit for limit in GAP_CLASSES if gap < limit)] += gap
            if gap < 20:
                idle_between[(last, e["name"])] += gap
            elif gap >= 100:
                long_gaps.append((gap, covered, last, e["name"]))
        if covered is None or e["ts"] > covered:
            busy += e["dur"]
        else:
            busy += max(0.0, e["ts"] + e["dur"] - covered)
        if covered is None or e["ts"] + e["dur"] >= covered:
            covered, last = e["ts"] + e["dur"], e["name"]
    launches = _graph_launches(trace_events)
    by_name, calls = collections.Counter(), collections.Counter()
    outside_graphs: dict[str, float] = collections.defaultdict(float)
    for e in events:
        by_name[e["name"]] += e["dur"]
        calls[e["name"]] += 1
        if e.get("args", {}).get("correlation") not in launches:
            outside_graphs[group_of(e["name"])] += e["dur"] / 1e6
    total = sum(by_name.values())
    groups: dict[str, float] = collections.defaultdict(float)
    for name, t in by_name.items():
        groups[group_of(name)] += t / 1e6
    return {"trace": path, "span_s": (end - start) / 1e6, "busy_s": busy / 1e6, "kernel_s": total / 1e6,
            "between_graphs": _between_graphs(events, launches),
            "groups_s": dict(groups), "outside_graphs_groups_s": dict(outside_graphs),
            "idle_s_by_gap_us": {f"<{limit:g}": idle[limit] / 1e6 for limit in GAP_CLASSES},
            "kernels": [{"name": name, "s": t / 1e6, "calls": calls[name]} for name, t in by_name.most_common()],
            "short_idle_between": [{"after": a, "before": b, "s": t / 1e6}
                                   for (a, b), t in idle_between.most_common(15)],
            "longest_gaps": [{"us": gap, "at_s": (at - start) / 1e6, "after": a, "before": b,
                              "host": _host_calls_during(host_events, host_starts, at, at + gap)}
                             for gap, at, a, b in sorted(long_gaps, reverse=True)[:15]]}


def _graph_launches(trace_events: list) -> set:
    """The correlation ids of the trace's graph replays (``cudaGraphLaunch``), which their kernels carry."""
    return {e["args"]["correlation"] for e in trace_events if e.get("name") == "cudaGraphLaunch"
            and e.get("ph") == "X" and "correlation" in e.get("args", {})}


def _between_graphs(events: list, launches: set) -> dict | None:
    """The device's time from one graph replay's last kernel to the next one's first (the step's inputs copied
    and prepared between them): how many intervals, their median and total, and the median count of copies and
    kernels in one. None when the trace has no graph replays."""
    spans: dict[int, list[float]] = {}
    for e in events:
        correlation = e.get("args", {}).get("correlation")
        if correlation in launches:
            first_last = spans.setdefault(correlation, [e["ts"], e["ts"] + e["dur"]])
            first_last[0], first_last[1] = min(first_last[0], e["ts"]), max(first_last[1], e["ts"] + e["dur"])
    ordered = sorted(spans.values())
    if len(ordered) < 2:
        return None
    starts = [e["ts"] for e in events]
    intervals, ops = [], []
    for (_, end), (begin, _) in zip(ordered, ordered[1:]):
        intervals.append(begin - end)
        ops.append(bisect.bisect_left(starts, begin) - bisect.bisect_left(starts, end))
    return {"intervals": len(intervals), "median_us": statistics.median(intervals), "total_s": sum(intervals) / 1e6,
            "median_ops": statistics.median(ops)}


def _host_calls_during(host_events: list, starts: list, begin: float, end: float, most: int = 4) -> list[str]:
    """The host's calls that took most of ``[begin, end)`` µs, what it did while the device waited (calls that
    span far more than the gap, such as the whole step, left out)."""
    first = bisect.bisect_left(starts, begin - 1e5)  # calls up to 0.1 s long that began before the gap
    limit = 10 * (end - begin)
    inside = [(min(e["ts"] + e["dur"], end) - max(e["ts"], begin), e["name"]) for e in host_events[first:]
              if e["ts"] < end and e["ts"] + e["dur"] > begin and e["dur"] <= limit]
    if not inside:
        return []
    inside.sort(reverse=True)
    return [f"{name[:50]} {overlap:.0f}us" for overlap, name in inside[:most]]


def print_trace_summary(summary: dict) -> None:
    span = summary["span_s"]
    print(f"{summary['trace']}: span {span:.3f} s, busy {summary['busy_s']:.3f} s "
          f"({summary['busy_s'] / span:.1%}), kernels summed {summary['kernel_s']:.3f} s")
    print("  " + ", ".join(f"{group} {seconds:.3f} s" for group, seconds in summary["groups_s"].items()))
    print("  of which outside graph replays (the eager steps: prefills): "
          + ", ".join(f"{group} {seconds:.3f} s" for group, seconds in summary["outside_graphs_groups_s"].items()))
    print("  idle by gap (µs): " + ", ".join(f"{gap} {seconds * 1e3:.1f} ms"
                                            for gap, seconds in summary["idle_s_by_gap_us"].items()))
    for kernel in summary["kernels"][:25]:
        print(f"{kernel['s']:8.3f} s {100 * kernel['s'] / summary['kernel_s']:5.1f}% {kernel['calls']:7d} calls  "
              f"{kernel['name'][:100]}")
    print("  idle in gaps under 20 µs, by the kernels on either side:")
    for pair in summary["short_idle_between"]:
        print(f"{pair['s'] * 1e3:8.1f} ms  {pair['after'][:60]}  ->  {pair['before'][:60]}")
    between = summary["between_graphs"]
    if between:
        print(f"  between graph replays: {between['intervals']} intervals, median {between['median_us']:.1f} µs "
              f"({between['median_ops']:g} copies and kernels), {between['total_s'] * 1e3:.1f} ms in all")
    print("  the longest gaps: µs, when (s into the span), the kernels on either side, the host's longest calls then:")
    for gap in summary["longest_gaps"]:
        print(f"{gap['us']:8.0f} us at {gap['at_s']:7.3f} s  {gap['after'][:40]}  ->  {gap['before'][:40]}  | "
              + "; ".join(gap["host"]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", nargs="+", default=None, help="summarize these traces of `dovetail bench --profile`")
    p.add_argument("--model", default="llama-3.1-8b", help="a named shape or a model directory")
    p.add_argument("--device", default=None)
    p.add_argument("--quantization", default=None)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--b1", type=int, default=0, help="profile the first N requests of B1 instead")
    p.add_argument("--prefill-only", action="store_true",
                   help="with --b1: one output token a request, and the products' TFLOP/s")
    p.add_argument("--stages", action="store_true", help="time the host's engine stages instead of kernels")
    p.add_argument("--enforce-eager", action="store_true", help="with --stages: no graphs")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.prefill_only and (not args.b1 or args.stages):
        p.error("--prefill-only profiles B1's prefill steps: it needs --b1 N and no --stages")
    if args.trace:
        summaries = [trace_summary(path) for path in args.trace]
        for summary in summaries:
            print_trace_summary(summary)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summaries, f, indent=1)
        return 0

    from dovetail.bench import shapes
    from dovetail.llm import LLM

    model_dir, defaults = shapes.materialize(args.model)
    flops_per_token = layer_product_flops_per_token(model_dir) if args.prefill_only else 0
    llm = LLM(model_dir, device=args.device, attention_backend=args.attention_backend, quantization=args.quantization,
              enforce_eager=True if not args.stages else (args.enforce_eager or None), **defaults)
    engine = llm.llm_engine
    result = {"model": args.model, "device": engine.platform.name, "attention_backend": engine.attention_backend.name,
              "quantization": args.quantization}
    if args.stages:
        result["stages"] = stages = host_stages(llm, args.b1)
        print(f"{stages['output_tokens']} output tokens in {stages['wall_s']:.3f} s, {stages['steps']} steps")
        for row in stages["stages"]:
            print(f"  {row['stage']:<36} {row['s']:8.3f} s {100 * row['s'] / stages['wall_s']:5.1f}%  x{row['calls']}")
    elif args.b1:
        result["b1"] = b1 = b1_kernels(llm, args.b1, args.prefill_only)
        print(f"B1 x{args.b1} eager: wall {b1['wall_s']:.2f} s, kernels {b1['kernel_s']:.2f} s, "
              f"{b1['prompt_tokens']} prompt and {b1['output_tokens']} output tokens")
        print("  " + ", ".join(f"{group} {seconds:.3f} s" for group, seconds in b1["groups_s"].items()))
        if args.prefill_only:
            b1["matmul_tflops"] = flops_per_token * b1["prompt_tokens"] / b1["groups_s"]["matmul"] / 1e12
            print(f"  the layers' products: {b1['matmul_tflops']:.1f} TFLOP/s")
        for kernel in b1["kernels"][:25]:
            print(f"{kernel['s']:8.3f} s {kernel['calls']:7d} calls  {kernel['name'][:110]}")
    else:
        result["decode_step"] = step = decode_step_kernels(llm)
        print(f"{args.model} {args.quantization or defaults.get('dtype', '')}: {step['us_per_step']:.1f} us of "
              "kernels per decode step")
        for kernel in step["kernels"][:30]:
            print(f"{kernel['us']:9.1f} us {kernel['calls']:6.1f} calls  {kernel['name'][:110]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
