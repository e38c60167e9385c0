"""What the benchmark commands share: arguments, engine construction, JSON output."""

from __future__ import annotations

import contextlib
import json
import platform as _platform
import subprocess
import sys
import time
from pathlib import Path

from dovetail.bench import shapes
from dovetail.cli.engine_args import add_engine_arguments, engine_kwargs


def add_common_arguments(p) -> None:
    add_engine_arguments(p)
    p.add_argument("--compare-hf", action="store_true", help="run HF transformers generate in the same run")
    p.add_argument("--output-json", default=None, help="also write the result to this file")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--profile", action="store_true",
                   help="run torch.profiler on every rank over the timed part (traces and summaries go to "
                        "DOVETAIL_TORCH_PROFILER_DIR; the figures then include the profiler's cost)")


@contextlib.contextmanager
def profiled(llm, enabled: bool):
    """Profile the block on every rank when ``enabled``; yields the list that receives the summaries' paths."""
    summaries: list[str] = []
    if not enabled:
        yield summaries
        return
    llm.start_profile()
    try:
        yield summaries
    finally:
        summaries.extend(llm.stop_profile())


def build_llm(args):
    """The LLM for ``args.model`` (a directory or a named shape) and the directory used."""
    from dovetail.llm import LLM

    if getattr(args, "profile", False):
        from dovetail.engine.profiler import profiler_dir

        profiler_dir()  # unset: the error comes before the model loads
    model = args.model or "c1"
    needs_tokenizer = getattr(args, "structured_output", None) is not None
    model_dir, defaults = shapes.materialize(model, with_tokenizer=needs_tokenizer)
    kwargs = {**defaults, **engine_kwargs(args)}
    t0 = time.perf_counter()
    llm = LLM(model_dir, **kwargs)
    return llm, model_dir, kwargs, time.perf_counter() - t0


def environment(platform=None) -> dict:
    """Where a benchmark ran: date, versions, commit, host and, given the engine's platform, its devices."""
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent, timeout=5).stdout.strip()
    except Exception:
        commit = ""
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": sys.version.split()[0],
            "torch": torch.__version__, "machine": _platform.machine(), "processor": _platform.processor(),
            "threads": torch.get_num_threads(), "commit": commit,
            "device": platform.describe() if platform is not None else None}


def draft_counts(engine) -> dict | None:
    """Speculative decoding's draft tokens and accepted tokens so far (None: the engine does not speculate)."""
    if engine.proposer is None:
        return None
    return {"draft_tokens": engine.num_draft_tokens, "accepted_tokens": engine.num_accepted_tokens,
            "acceptance_rate": engine.num_accepted_tokens / max(engine.num_draft_tokens, 1)}


def all_reduce_kernel(engine) -> str | None:
    """The kernel rank 0 sums its row-parallel outputs with (None with one rank): a figure at several ranks
    depends on it, and which one ``auto`` takes depends on the machine (FlashInfer's fused kernels only once
    built there)."""
    return engine.executor.collective_rpc("describe")[0]["all_reduce"]


def emit(result: dict, path: str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        Path(path).write_text(text + "\n")
