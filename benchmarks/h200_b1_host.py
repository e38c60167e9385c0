"""Where B1's host time goes on the H200: cProfile of one ``LLM.generate`` of B1 (qwen3-0.6b by default).

    python3 benchmarks/h200_b1_host.py [--model qwen3-0.6b] [--num 256]

Prints the wall time without and with the profiler and the 30 functions with the most own time.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

from h200_profile_decode import b1_script_setup  # benchmarks/, this script's directory

from dovetail.bench.workload import greedy_inputs, random_requests, warm_up


def main() -> None:
    args, _, llm = b1_script_setup("qwen3-0.6b", 256)
    requests = random_requests(args.num, (100, 1024), (100, 1024), llm.llm_engine.vocab_size, 0)
    prompts, params = greedy_inputs(requests)
    warm_up(llm, prompts, params)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    plain = time.perf_counter() - start
    prompts = [{"prompt_token_ids": p["prompt_token_ids"][1:]} for p in prompts]  # no prefix-cache hits
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    profiled = time.perf_counter() - start
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)
    print(f"{args.model} B1 x{args.num}: {plain:.2f} s, {profiled:.2f} s under cProfile")
    print(out.getvalue()[-6000:])


if __name__ == "__main__":
    main()
