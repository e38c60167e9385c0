"""``dovetail bench throughput``: B1 (GPU) / C1 (CPU) offline throughput, against HF if asked.

Output tokens divided by the wall time of ``LLM.generate`` over the whole
request set, after one warm-up call. ``enqueue_seconds`` is the part of that
time ``LLM.generate`` took to queue every request (from the call to the last
request's arrival). ``--prompt TEXT`` gives every request that text instead of
random token ids, so that queueing includes tokenising. ``--structured-output
json`` adds the same run under a JSON schema (:mod:`dovetail.bench.structured`). ``--step-stats`` adds
where the timed run's wall time went, by kind of step, and the decode steps that stalled
(:mod:`dovetail.bench.step_stats`). ``--lora-adapters K`` runs every request with one of ``K`` random LoRA
adapters (round robin; rank ``--max-lora-rank``, every projection), to measure serving adapters.
"""

from __future__ import annotations

import sys
import time

from dovetail.bench.common import (add_common_arguments, all_reduce_kernel, build_llm, draft_counts, emit, environment,
                                   profiled)
from dovetail.bench.step_stats import format_summary, recorded_steps
from dovetail.bench.workload import BenchRequest, greedy_inputs, parse_range, random_requests, warm_up

#: Defaults per named shape: (requests, prompt range, output range, HF batch size). Every GPU shape runs B1
#: (with seed 0: the peer's 256 requests, 140,797 output tokens), ``c1`` runs C1.
DEFAULTS = {"c1": (64, "64:256", "64:128", 64), None: (256, "100:1024", "100:1024", 64)}


def add_parser(sub) -> None:
    p = sub.add_parser("throughput", help="offline throughput (B1 on GPUs, C1 on the CPU)")
    add_common_arguments(p)
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--input-len", default=None, help="LOW:HIGH prompt lengths (uniform)")
    p.add_argument("--output-len", default=None, help="LOW:HIGH output lengths (uniform)")
    p.add_argument("--hf-batch-size", type=int, default=None)
    p.add_argument("--prompt", default=None, metavar="TEXT",
                   help="every request's prompt is this text (tokenised by generate) instead of random token ids")
    p.add_argument("--structured-output", choices=("json",), default=None,
                   help="run the requests again, each under one JSON schema, and report both runs, their ratio "
                        "and the grammar's compile time (a named shape gets a synthetic tokenizer)")
    p.add_argument("--lora-adapters", type=int, default=0, metavar="K",
                   help="every request runs with one of K random LoRA adapters of rank --max-lora-rank on every "
                        "projection (needs --enable-lora; --max-loras K puts them all in one batch)")
    p.add_argument("--step-stats", action="store_true",
                   help="report the timed run's wall time by kind of step: prefill, and decode-only steps by "
                        "their number of sequences; and the decode steps that stalled (much longer than their "
                        "neighbours)")
    p.set_defaults(func=run)


def workload(args, vocab_size: int) -> tuple[list[BenchRequest], tuple[int, int], tuple[int, int]]:
    """The requests ``args`` ask for and their length ranges: B1's for a GPU shape, C1's for ``c1``, unless
    ``--num-prompts``/``--input-len``/``--output-len``/``--workload-seed`` say otherwise."""
    num, in_range, out_range, _ = DEFAULTS.get(args.model or "c1", DEFAULTS[None])
    num = args.num_prompts or num
    in_range = parse_range(args.input_len or in_range)
    out_range = parse_range(args.output_len or out_range)
    return random_requests(num, in_range, out_range, vocab_size, args.workload_seed), in_range, out_range


def _lora_requests(args, engine, num: int) -> list | None:
    """Each request's adapter, round robin over ``--lora-adapters`` random ones; None without them."""
    if not args.lora_adapters:
        return None
    import tempfile

    from dovetail.bench.lora_adapters import random_adapters

    lora = engine.config.lora
    if not lora.enable_lora:
        raise SystemExit("--lora-adapters: needs --enable-lora")
    directory = tempfile.mkdtemp(prefix="dovetail-bench-lora-")
    adapters = random_adapters(engine.hf_config, args.lora_adapters, lora.max_lora_rank, directory)
    return [adapters[i % len(adapters)] for i in range(num)]


def run(args) -> int:
    if args.prompt is not None and args.compare_hf:
        raise SystemExit("--prompt: HF runs the random token-id requests; leave out --compare-hf")
    hf_batch = args.hf_batch_size or DEFAULTS.get(args.model or "c1", DEFAULTS[None])[3]
    llm, model_dir, kwargs, load_s = build_llm(args)
    engine = llm.llm_engine
    requests, in_range, out_range = workload(args, engine.vocab_size)
    num = len(requests)
    prompts, params = greedy_inputs(requests)
    loras = _lora_requests(args, engine, num)
    if args.prompt is not None:
        llm.generate([args.prompt[::-1]] * 2, params[:2], use_tqdm=False)  # the warm-up, on other text
        prompts = [args.prompt] * num
    else:
        warm_up(llm, prompts, params, loras[:2] if loras else None)
    with profiled(llm, args.profile) as summaries, recorded_steps(engine, args.step_stats) as steps:
        t0, t0_monotonic = time.perf_counter(), time.monotonic()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        elapsed = time.perf_counter() - t0
    enqueue = max(o.metrics.arrival_time for o in outputs) - t0_monotonic
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    result = {
        "benchmark": "throughput", "model": args.model or "c1", "engine_args": kwargs, "environment": environment(engine.platform),
        "num_requests": num, "input_len": list(in_range), "output_len": list(out_range), "prompt": args.prompt,
        "dovetail": {"output_tokens": out_tokens, "prompt_tokens": in_tokens, "seconds": elapsed,
                     "enqueue_seconds": enqueue,
                     "output_tokens_per_s": out_tokens / elapsed, "total_tokens_per_s": (out_tokens + in_tokens) / elapsed,
                     "device": engine.platform.name, "attention_backend": engine.attention_backend.name,
                     "world_size": engine.world_size, "executor": engine.executor_name,
                     "all_reduce": all_reduce_kernel(engine),
                     "kv_cache_blocks_per_rank": engine.num_blocks, "kv_block_size": engine.config.cache.block_size,
                     "profile_summaries": summaries, "load_seconds": load_s, "preemptions": engine.scheduler.num_preemptions,
                     "lora_adapters": args.lora_adapters, "speculative": draft_counts(engine)},
    }
    if args.step_stats:
        result["dovetail"]["step_stats"] = steps
        print(format_summary(steps), file=sys.stderr)
    if args.structured_output == "json":
        from dovetail.bench.structured import run_constrained

        result["structured_output"] = run_constrained(llm, prompts, params, result["dovetail"])
    if args.compare_hf:
        from dovetail.bench.hf_peer import hf_throughput, load_hf_model

        device = str(engine.device)
        del llm, engine
        model = load_hf_model(model_dir, kwargs.get("dtype", "auto"), device, kwargs.get("load_format") == "dummy")
        hf_throughput(model, requests[:2], 2, device)  # warm-up
        result["hf"] = hf_throughput(model, requests, hf_batch, device)
        result["speedup_vs_hf"] = result["dovetail"]["output_tokens_per_s"] / result["hf"]["output_tokens_per_s"]
    emit(result, args.output_json)
    return 0
