"""``dovetail generate PROMPT...``: offline generation on the command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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
    c = p.add_argument_group("structured outputs (one of)").add_mutually_exclusive_group()
    c.add_argument("--json-schema", metavar="FILE", help="the output is JSON following the schema in FILE")
    c.add_argument("--regex", help="the output matches this regular expression")
    c.add_argument("--choice", nargs="+", metavar="TEXT", help="the output is one of these texts")
    c.add_argument("--grammar", metavar="FILE", help="the output follows the grammar in FILE (EBNF or Lark)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=run)


def _read(path: str, flag: str) -> str:
    from dovetail.errors import ConfigError

    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {path}: {exc.strerror}") from None


def structured_outputs(args: argparse.Namespace):
    """The constraint the flags ask for (checked, a malformed one naming its flag), or None."""
    from dovetail.engine.grammar import parse_grammar
    from dovetail.errors import ConfigError
    from dovetail.sampling_params import StructuredOutputsParams

    if args.json_schema is not None:
        text = _read(args.json_schema, "--json-schema")
        try:
            spec, flag = StructuredOutputsParams(json=json.loads(text)), "--json-schema"
        except ValueError as exc:
            raise ConfigError(f"--json-schema: {args.json_schema} is not JSON: {exc}") from None
    elif args.regex is not None:
        spec, flag = StructuredOutputsParams(regex=args.regex), "--regex"
    elif args.choice is not None:
        spec, flag = StructuredOutputsParams(choice=args.choice), "--choice"
    elif args.grammar is not None:
        spec, flag = StructuredOutputsParams(grammar=_read(args.grammar, "--grammar")), "--grammar"
    else:
        return None
    parse_grammar(spec, flag)
    return spec


def run(args: argparse.Namespace) -> int:
    from dovetail.llm import LLM
    from dovetail.sampling_params import SamplingParams

    from dovetail.errors import RequestError

    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if "" in prompts:  # before the model loads
        raise RequestError(f"prompt: prompt {prompts.index('') + 1} is empty", field="prompt")
    constraint = structured_outputs(args)
    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, n=args.n, seed=args.sampling_seed, stop=args.stop,
                            structured_outputs=constraint)
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
