"""Where a batch-1 decode step spends its GPU time: kernel by kernel, and the GEMV bandwidth it reaches.

    python3 benchmarks/h200_profile_decode.py --model llama-3.1-8b [--quantization fp8] [--gemv]
    python3 benchmarks/h200_profile_decode.py --model qwen3-0.6b --b1 64

``--b1 N`` instead profiles the first N requests of B1's workload (BENCHMARKS.md) run eagerly in one
``generate``: every kernel's total GPU time, and their sum against the wall time.

The engine runs eagerly (CUDA graphs change launch gaps, not kernel durations) under
``torch.profiler``. One request of 128 prompt tokens is generated twice, with 1 and
with 65 output tokens; the difference of each kernel's total GPU time, divided by 64,
is that kernel's cost per decode step (prefill and start-up cancel out). ``--gemv``
first times cuBLAS ``F.linear`` at M=1 on the model's projection shapes (several
weight copies in rotation so none stays in L2) and a device-to-device copy. Prints
tables and writes ``$OUT/profile_<model>[_<quant>].json``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from pathlib import Path

import torch

LLAMA_8B_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                   "lm_head": (128256, 4096)}


def time_graph(fn, iters: int = 20, repeats: int = 5) -> float:
    """Median microseconds per ``fn()`` call, ``iters`` calls captured in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / iters)
    return sorted(times)[len(times) // 2]


def time_linear(linear, x: torch.Tensor, weights: list[torch.Tensor], iters: int | None = None) -> float:
    """Median microseconds of one ``linear(x, w)``, the ``iters`` calls of a CUDA graph (default: twice the
    weights, at least 8) rotating through ``weights``."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(weights)
        linear(x, weights[state["i"]])

    return time_graph(call, iters=iters or max(8, 2 * len(weights)))


def gemv_bandwidth() -> dict:
    """cuBLAS bf16 GEMV at M=1 on llama-3.1-8b's shapes, and the copy bandwidth, in GB/s."""
    results = {}
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_graph(lambda: dst.copy_(src), iters=5)
    results["copy_GBps"] = 2 * src.numel() / us / 1e3
    for name, (n, k) in LLAMA_8B_SHAPES.items():
        copies = max(2, (256 * 1024**2) // (n * k * 2) + 1)
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        us = time_linear(torch.nn.functional.linear, x, weights, iters=copies * 4)
        results[name] = {"us": us, "GBps": n * k * 2 / us / 1e3}
        del weights
    return results


def _kernel_times(prof) -> dict[str, tuple[float, int]]:
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = event.self_cuda_time_total
        if device_us > 0:
            totals[event.key][0] += device_us
            totals[event.key][1] += event.count
    return {k: (v[0], v[1]) for k, v in totals.items()}


def profile_decode(model: str, quantization: str | None, backend: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from dovetail.bench import shapes
    from dovetail.llm import LLM
    from dovetail.sampling_params import SamplingParams

    model_dir, defaults = shapes.materialize(model)
    llm = LLM(model_dir, attention_backend=backend, enforce_eager=True, quantization=quantization, **defaults)
    prompt = [{"prompt_token_ids": list(range(1000, 1128))}]

    def run(tokens: int):
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)

    run(8)
    measured = {}
    for tokens in (1, 65):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(tokens)
            torch.cuda.synchronize()
        measured[tokens] = _kernel_times(prof)
    per_step = {}
    for name in set(measured[1]) | set(measured[65]):
        t65, c65 = measured[65].get(name, (0.0, 0))
        t1, c1 = measured[1].get(name, (0.0, 0))
        per_step[name] = {"us": (t65 - t1) / 64, "calls": (c65 - c1) / 64}
    ranked = sorted(per_step.items(), key=lambda kv: -kv[1]["us"])
    total = sum(v["us"] for _, v in ranked)
    return {"model": model, "quantization": quantization, "backend": backend, "gpu_us_per_step": total,
            "kernels": [{"name": k[:140], **v} for k, v in ranked if abs(v["us"]) > 0.05]}


def profiled_b1(llm, num: int):
    """(profiler, wall seconds, requests) of one ``generate`` of B1's first ``num`` requests, after a warm-up."""
    import time

    from torch.profiler import ProfilerActivity, profile

    from dovetail.bench.workload import greedy_inputs, random_requests, warm_up

    requests = random_requests(num, (100, 1024), (100, 1024), llm.llm_engine.vocab_size, 0)
    prompts, params = greedy_inputs(requests)
    warm_up(llm, prompts, params)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    return prof, wall, requests


def b1_script_setup(model: str, num: int):
    """The start of the B1 profiling scripts: ``--model`` and ``--num`` (defaulting to ``model`` and ``num``),
    ``$OUT`` made, and the model's ``LLM`` as ``dovetail bench throughput`` builds it (dummy weights, TRITON,
    CUDA graphs). Returns ``(args, out, llm)``."""
    from dovetail.bench import shapes
    from dovetail.llm import LLM

    p = argparse.ArgumentParser()
    p.add_argument("--model", default=model)
    p.add_argument("--num", type=int, default=num)
    args = p.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    model_dir, defaults = shapes.materialize(args.model)
    return args, out, LLM(model_dir, attention_backend="TRITON", **defaults)


def profile_b1(model: str, quantization: str | None, backend: str, num: int) -> dict:
    from dovetail.bench import shapes
    from dovetail.llm import LLM

    model_dir, defaults = shapes.materialize(model)
    llm = LLM(model_dir, attention_backend=backend, enforce_eager=True, quantization=quantization, **defaults)
    prof, wall, requests = profiled_b1(llm, num)
    kernels = sorted(_kernel_times(prof).items(), key=lambda kv: -kv[1][0])
    total = sum(t for t, _ in dict(kernels).values())
    groups = defaultdict(float)
    for name, (t, _) in kernels:
        groups[group_of(name)] += t / 1e6
    del llm
    return {"model": model, "quantization": quantization, "backend": backend, "requests": num, "wall_s": wall,
            "output_tokens": sum(r.output_len for r in requests), "gpu_s": total / 1e6, "groups_s": dict(groups),
            "kernels": [{"name": k[:140], "s": t / 1e6, "calls": c} for k, (t, c) in kernels[:40]]}


#: Kernel-name substrings of each group that ``--b1`` sums.
KERNEL_GROUPS = {"attention": ("paged_attention", "reduce_splits", "flashinfer", "flash_fwd", "BatchDecode",
                               "BatchPrefill"),
                 "matmul": ("nvjet", "gemm", "cutlass", "splitKreduce", "_gemv_kernel", "sm90_xmma", "cublas"),
                 "norm, rotary, activation, KV write": ("_rms_norm", "_rotary", "_act_and_mul", "_kv_cache_write",
                                                        "_fused")}


def group_of(kernel: str) -> str:
    """The :data:`KERNEL_GROUPS` group a kernel name falls in, else ``"other"``."""
    return next((g for g, keys in KERNEL_GROUPS.items() if any(key in kernel for key in keys)), "other")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--quantization", default=None)
    p.add_argument("--attention-backend", default="TRITON")
    p.add_argument("--gemv", action="store_true")
    p.add_argument("--b1", type=int, default=0, help="profile the first N requests of B1 instead")
    args = p.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    suffix = f"_{args.quantization}" if args.quantization else ""
    if args.b1:
        b1 = profile_b1(args.model, args.quantization, args.attention_backend, args.b1)
        print(f"{args.model} B1 x{args.b1} eager: wall {b1['wall_s']:.2f} s, kernels {b1['gpu_s']:.2f} s, "
              f"{b1['output_tokens']} output tokens")
        print("  " + ", ".join(f"{group} {seconds:.3f} s" for group, seconds in b1["groups_s"].items()))
        for kernel in b1["kernels"][:25]:
            print(f"{kernel['s']:8.3f} s {kernel['calls']:7d} calls  {kernel['name'][:110]}")
        (out / f"profile_b1_{args.model}{suffix}.json").write_text(json.dumps(b1, indent=1))
        return 0
    result = {}
    if args.gemv:
        result["gemv"] = gemv_bandwidth()
        print(json.dumps(result["gemv"]))
    result["profile"] = profile_decode(args.model, args.quantization, args.attention_backend)
    prof = result["profile"]
    print(f"{args.model} {args.quantization or 'bf16'}: GPU time per decode step {prof['gpu_us_per_step']:.1f} us")
    for kernel in prof["kernels"][:30]:
        print(f"{kernel['us']:9.1f} us {kernel['calls']:6.1f} calls  {kernel['name'][:110]}")
    (out / f"profile_{args.model}{suffix}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
