"""``dovetail``: generate, serve, benchmark, and inspect plugins.

Each subcommand lives in its own module exposing ``add_parser(subparsers)``;
errors Dovetail raises on purpose are printed as one clear line (exit 2).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from dovetail.errors import DovetailError

SUBCOMMANDS = ("plugins", "generate", "serve", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dovetail", description="LLM inference and serving; hardware and "
                                                                   "models are plugins.")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"dovetail.cli.{name}_cmd")
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except DovetailError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
