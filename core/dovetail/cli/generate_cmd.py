"""``dovetail generate PROMPT...``: offline generation on the command line."""

from __future__ import annotations

import argparse
import json
import sys

from dovetail.cli.engine_args import add_engine_arguments, engine_kwargs


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for prompts (default model: the bundled one)")
    p.add_argument("prompts", nargs="*", help="prompts (read from stdin, one per line, when none)")
    add_engine_arguments(p)
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=32)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--n", type=int, default=1)
    s.add_argument("--sampling-seed", type=int, default=None)
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--chat", action="store_true", help="send each prompt as a user message through the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dovetail.llm import LLM
    from dovetail.sampling_params import SamplingParams

    from dovetail.errors import RequestError

    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if "" in prompts:  # before the model loads
        raise RequestError(f"prompt: prompt {prompts.index('') + 1} is empty", field="prompt")
    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, n=args.n, seed=args.sampling_seed, stop=args.stop)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "outputs": [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason} for c in out.outputs]}))
        else:
            for c in out.outputs:
                print(f"{prompt}{c.text}")
    return 0
