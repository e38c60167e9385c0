"""Start-up time to the first generated token: from launching a fresh Python process to its first token.

    python benchmarks/startup.py --model qwen3-0.6b [--attention-backend TRITON] [--enforce-eager] [--device D] [-tp N]

The parent writes a named shape's model directory (its config.json; dummy weights) as a user's model would
already be on disk, notes the wall clock, starts a child interpreter that imports Dovetail, builds the engine
and generates one token for a 128-token prompt, and reports the child's phases: the engine's own
(configuration, workers and weights, memory profile, KV cache and graphs) and the slowest rank's (its process
coming up and waiting for its work, which overlap the engine's configuration with several ranks; device and
process group, all-reduce setup, model configuration, model, weights, model runner). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def child(args) -> None:
    t_start = time.time()
    from dovetail.llm import LLM
    from dovetail.sampling_params import SamplingParams

    t_import = time.time()
    llm = LLM(args.model, device=args.device, attention_backend=args.attention_backend,
              enforce_eager=args.enforce_eager or None, tensor_parallel_size=args.tensor_parallel_size,
              **json.loads(args.engine_defaults))
    t_engine = time.time()
    vocab = llm.llm_engine.vocab_size
    llm.generate([{"prompt_token_ids": [token % vocab for token in range(1000, 1128)]}],
                 SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    t_token = time.time()
    print(json.dumps({"child_start": t_start, "imported": t_import, "engine_ready": t_engine, "first_token": t_token,
                      "attention_backend": llm.llm_engine.attention_backend.name,
                      "engine_phases": llm.llm_engine.startup_phases,
                      "worker_phases": llm.llm_engine.slowest_rank_startup(),
                      "graphs": llm.llm_engine.executor.collective_rpc("describe")[0]["graph_sizes"] is not None}))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--child", action="store_true")
    p.add_argument("--engine-defaults", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    from dovetail.bench import shapes

    model_dir, defaults = shapes.materialize(args.model)  # the model is on disk before the clock starts
    t0 = time.time()
    command = [sys.executable, __file__, "--child", "--model", model_dir, "-tp", str(args.tensor_parallel_size),
               "--engine-defaults", json.dumps(defaults)]
    for flag, value in (("--attention-backend", args.attention_backend), ("--device", args.device)):
        if value:
            command += [flag, value]
    if args.enforce_eager:
        command.append("--enforce-eager")
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        print(done.stderr[-4000:], file=sys.stderr)
        return done.returncode
    times = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps({"model": args.model, "tensor_parallel_size": args.tensor_parallel_size,
                      "attention_backend": times["attention_backend"],
                      "graphs": times["graphs"],
                      "startup_to_first_token_s": times["first_token"] - t0,
                      "interpreter_s": times["child_start"] - t0, "imports_s": times["imported"] - times["child_start"],
                      "engine_s": times["engine_ready"] - times["imported"],
                      "engine_phases": {name: round(seconds, 2) for name, seconds in times["engine_phases"].items()},
                      "worker_phases": times["worker_phases"],
                      "first_token_s": times["first_token"] - times["engine_ready"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
