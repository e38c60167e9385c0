"""``dovetail bench throughput|latency|serve``: the benchmarks of docs/benchmarks.md."""

from __future__ import annotations

import importlib

BENCHMARKS = ("throughput", "latency", "serve")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: throughput (B1/C1), latency (B2/C2), serve (B3)")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    for name in BENCHMARKS:
        try:
            module = importlib.import_module(f"dovetail.bench.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"dovetail.bench.{name}":
                raise
            continue
        module.add_parser(bench_sub)
