"""``dovetail serve MODEL``: the OpenAI-compatible server."""

from __future__ import annotations

import argparse

from dovetail.cli.engine_args import add_engine_arguments


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible server")
    add_engine_arguments(p, model_positional=True)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise SystemExit("dovetail serve: not available yet")
