"""``dovetail bench latency``: B2 (GPU) / C2 (CPU) batch-1 decode, ms per output token, prefill excluded.

``--batch-size N`` decodes N requests of the same lengths together (random prompts of their own): the figure is
then the time of one decode step of N sequences."""

from __future__ import annotations

import time

from dovetail.bench.common import (add_common_arguments, all_reduce_kernel, build_llm, draft_counts, emit, environment,
                                   profiled)
from dovetail.bench.workload import random_requests
from dovetail.engine.frozen_heap import frozen_heap


def add_parser(sub) -> None:
    p = sub.add_parser("latency", help="batch-1 decode latency (B2 on GPUs, C2 on the CPU)")
    add_common_arguments(p)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="runs; the median is reported")
    p.add_argument("--batch-size", type=int, default=1,
                   help="requests decoded together; the figure is then one decode step's time (default 1: B2/C2)")
    p.set_defaults(func=run)


def _decode_ms(engine, prompts: list[list[int]], output_len: int, request_id: str) -> tuple[float, float]:
    """(prefill ms, decode ms per step) of ``prompts`` run together, alone in the engine."""
    from dovetail.sampling_params import SamplingParams

    for index, prompt_ids in enumerate(prompts):
        engine.add_request(f"{request_id}-{index}", {"prompt_token_ids": prompt_ids},
                           SamplingParams(temperature=0, ignore_eos=True, max_tokens=output_len))
    t0 = time.perf_counter()
    first = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if first is None and outputs and outputs[0].outputs[0].token_ids:
            first = time.perf_counter()
    end = time.perf_counter()
    return (first - t0) * 1000, (end - first) / (output_len - 1) * 1000


def run(args) -> int:
    import statistics

    if args.batch_size < 1:
        raise SystemExit(f"--batch-size: must be at least 1 (got {args.batch_size})")
    if args.batch_size > 1 and args.compare_hf:
        raise SystemExit("--compare-hf: HF runs batch-1 decode only; leave out --batch-size")
    llm, model_dir, kwargs, load_s = build_llm(args)
    engine = llm.llm_engine
    prompts = [r.prompt_token_ids for r in random_requests(args.batch_size, (args.input_len, args.input_len), (1, 1),
                                                           engine.vocab_size, args.workload_seed)]
    _decode_ms(engine, prompts, 8, "warmup")
    with profiled(llm, args.profile) as summaries, frozen_heap():  # as LLM.generate runs its steps
        runs = [_decode_ms(engine, prompts, args.output_len, f"r{i}") for i in range(args.repeats)]
    prompt = prompts[0]
    result = {
        "benchmark": "latency", "model": args.model or "c1", "engine_args": kwargs, "environment": environment(engine.platform),
        "input_len": args.input_len, "output_len": args.output_len, "batch_size": args.batch_size,
        "dovetail": {"ms_per_token": statistics.median(r[1] for r in runs),
                     "ms_per_token_runs": [r[1] for r in runs], "prefill_ms": statistics.median(r[0] for r in runs),
                     "device": engine.platform.name, "attention_backend": engine.attention_backend.name,
                     "world_size": engine.world_size, "executor": engine.executor_name,
                     "all_reduce": all_reduce_kernel(engine),
                     "kv_cache_blocks_per_rank": engine.num_blocks, "kv_block_size": engine.config.cache.block_size,
                     "profile_summaries": summaries, "load_seconds": load_s,
                     "speculative": draft_counts(engine)},
    }
    if args.compare_hf:
        from dovetail.bench.hf_peer import hf_latency, load_hf_model

        device = str(engine.device)
        del llm, engine
        model = load_hf_model(model_dir, kwargs.get("dtype", "auto"), device, kwargs.get("load_format") == "dummy")
        result["hf"] = hf_latency(model, prompt, args.output_len, device)
        result["hf_over_dovetail"] = result["hf"]["ms_per_token"] / result["dovetail"]["ms_per_token"]
    emit(result, args.output_json)
    return 0
