"""Which Triton kernels compile when, during one ``dovetail`` command (``dovetail bench`` on a GPU, say).

A kernel variant first met inside a benchmark's timed ``LLM.generate`` is compiled there (or loaded from
triton's disk cache) and its cost is counted as the engine's. This runs the command given after the script's
name in this process, with triton's JIT hooks recording every compile: the phase (start-up, or which
``generate`` call), the engine step that asked for it (its sequences, decodes and tokens; a graph replay or
eager), the kernel, its constexprs and the seconds it took.

    python3 benchmarks/triton_compiles.py [--json FILE] bench throughput --model qwen3-0.6b --dtype bfloat16 \\
        --attention-backend TRITON

Prints one line per compile, then the count and seconds per phase. Needs triton >= 3.4 (``triton.knobs``).
"""

from __future__ import annotations

import json
import sys
import time


class CompileLog:
    """Triton compiles, each with the phase and the engine step it happened in."""

    def __init__(self):
        self.phase = "start-up"
        self.step = "-"
        self.records: list[dict] = []
        self._open: dict[str, dict] = {}

    def before(self, *args, **kwargs):
        fn, compile_info = kwargs.get("fn"), kwargs.get("compile") or {}
        names = list(getattr(getattr(fn, "jit_function", None), "arg_names", []))
        constants = {}
        for path, value in (compile_info.get("constants") or {}).items():
            index = path[0] if isinstance(path, tuple) and len(path) == 1 else path
            constants[names[index] if isinstance(index, int) and index < len(names) else str(index)] = value
        record = {"phase": self.phase, "step": self.step, "kernel": getattr(fn, "name", str(fn)),
                  "constants": constants, "signature": str(kwargs.get("repr"))[:1500],
                  "started": time.perf_counter()}
        self._open[str(kwargs.get("key"))] = record
        self.records.append(record)
        return False  # False: compile as usual

    def after(self, *args, **kwargs):
        record = self._open.pop(str(kwargs.get("key")), None)
        if record is not None:
            record["seconds"] = round(time.perf_counter() - record.pop("started"), 3)


def install(log: CompileLog) -> None:
    """Point triton's hooks at ``log``; name each ``LLM.generate`` call and each engine step in it."""
    from triton import knobs

    knobs.runtime.jit_cache_hook = log.before
    knobs.runtime.jit_post_compile_hook = log.after

    from dovetail.engine.model_runner import ModelRunner
    from dovetail.llm import LLM

    generate, execute = LLM.generate, ModelRunner.execute
    calls = [0]

    def named_generate(self, *args, **kwargs):
        calls[0] += 1
        log.phase = f"generate {calls[0]}"
        try:
            return generate(self, *args, **kwargs)
        finally:
            log.phase, log.step = f"after generate {calls[0]}", "-"

    def described_execute(self, batch, *args, **kwargs):
        decodes = sum(1 for n in batch.num_new_tokens if n == 1)
        graph = self.graphs is not None and self.graphs.can_run(batch)
        log.step = (f"{'graph' if graph else 'eager'} seqs={len(batch.requests)} decodes={decodes} "
                    f"tokens={sum(batch.num_new_tokens)}")
        return execute(self, batch, *args, **kwargs)

    LLM.generate, ModelRunner.execute = named_generate, described_execute


def _arguments(signature: str) -> dict[str, str]:
    inside = signature[signature.find("](") + 2:].rstrip(")")
    return dict(part.split(": ", 1) for part in inside.split(", ") if ": " in part)


def _difference(record: dict, earlier: dict | None) -> str:
    """What sets ``record`` apart from the kernel's previous compile: constexprs, else argument types."""
    if earlier is None:
        return str({k: v for k, v in record["constants"].items() if k.isupper()})
    changed = {k: v for k, v in record["constants"].items() if earlier["constants"].get(k) != v}
    if changed:
        return f"constexprs {changed}"
    now, before = _arguments(record["signature"]), _arguments(earlier["signature"])
    return f"arguments {({k: v for k, v in now.items() if before.get(k) != v}) or record['signature'][:200]}"


def summary(records: list[dict]) -> str:
    lines, last = [], {}
    for r in records:
        lines.append(f"{r['phase']:<18} {r.get('seconds', float('nan')):7.3f}s  {r['kernel']:<28} [{r['step']}] "
                     f"{_difference(r, last.get(r['kernel']))}")
        last[r["kernel"]] = r
    phases: dict[str, list[float]] = {}
    for r in records:
        phases.setdefault(r["phase"], []).append(r.get("seconds", 0.0))
    for phase, seconds in phases.items():
        lines.append(f"-- {phase}: {len(seconds)} compiles, {sum(seconds):.2f} s")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    json_path = None
    if argv[:1] == ["--json"]:
        json_path, argv = argv[1], argv[2:]
    log = CompileLog()
    install(log)
    from dovetail.cli.main import main as dovetail_main

    status = dovetail_main(argv)
    print(summary(log.records), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(log.records, f, indent=1, default=str)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
