"""Where a throughput run's wall time goes, step by step: ``dovetail bench throughput --step-stats``.

The scheduler's batches and the times ``LLMEngine.step`` returns are recorded in the bench's process only
(nothing is added to the engine's own path). With overlapped scheduling a step returns once the step
*before* it has finished on the devices, so the time between two returns is charged to the batch launched
by the first of them; when the devices are the bottleneck that is the batch's device time.

Steps are grouped into those with prompt tokens (prefill, possibly with decodes beside them) and decode-only
steps by their number of sequences, so a run's time can be set against each group's bound (weights read
once a step, the KV cache read by attention).
"""

from __future__ import annotations

import contextlib
import time

#: Upper edges of the decode-only groups, by sequences in the step.
DECODE_GROUPS = (1, 8, 32, 64, 128, 192, 256, 512, 1024)


def _group(num_seqs: int) -> str:
    low = 1
    for high in DECODE_GROUPS:
        if num_seqs <= high:
            return f"decode {low}-{high}"
        low = high + 1
    return f"decode >{DECODE_GROUPS[-1]}"


@contextlib.contextmanager
def recorded_steps(engine, enabled: bool = True):
    """Record each step of ``engine`` while the block runs; yields a dict that holds the summary afterwards."""
    summary: dict = {}
    if not enabled:
        yield summary
        return
    scheduler = engine.scheduler
    schedule, step = scheduler.schedule, engine.step
    launched: list[tuple[int, int, int]] = []  # (sequences, prompt tokens, decode tokens) of each batch
    returns: list[float] = []

    def recording_schedule():
        batch = schedule()
        if batch:
            decodes = sum(1 for n in batch.num_new_tokens if n == 1)
            launched.append((len(batch.requests), batch.total_tokens - decodes, decodes))
        else:
            launched.append((0, 0, 0))
        return batch

    def recording_step():
        outputs = step()
        returns.append(time.perf_counter())
        return outputs

    scheduler.schedule, engine.step = recording_schedule, recording_step
    start = time.perf_counter()
    try:
        yield summary
    finally:
        del scheduler.schedule, engine.step  # back to the class's methods
        summary.update(summarize(launched, returns, start, engine.overlap))


def summarize(launched: list[tuple[int, int, int]], returns: list[float], start: float, overlap: bool) -> dict:
    """Charge each interval between step returns to its batch (the one launched a step earlier under
    overlap) and sum them by group."""
    marks = [start] + returns
    groups: dict[str, dict] = {}
    shift = 1 if overlap else 0
    for i in range(len(returns) - shift):
        seqs, prompt_tokens, decode_tokens = launched[i] if i < len(launched) else (0, 0, 0)
        if seqs == 0:
            continue
        seconds = marks[i + 1 + shift] - marks[i + shift]
        name = "prefill" if prompt_tokens else _group(seqs)
        g = groups.setdefault(name, {"steps": 0, "seconds": 0.0, "prompt_tokens": 0, "decode_tokens": 0})
        g["steps"] += 1
        g["seconds"] += seconds
        g["prompt_tokens"] += prompt_tokens
        g["decode_tokens"] += decode_tokens
    for g in groups.values():
        g["ms_per_step"] = 1e3 * g["seconds"] / g["steps"]
    total = marks[-1] - start
    return {"seconds": total, "steps": sum(g["steps"] for g in groups.values()), "groups": groups}


def format_summary(summary: dict) -> str:
    """A few lines for the log: each group's steps, seconds, share and milliseconds a step."""
    total = summary["seconds"] or 1.0
    lines = [f"{summary['steps']} steps in {summary['seconds']:.2f} s"]
    for name, g in sorted(summary["groups"].items(), key=lambda kv: -kv[1]["seconds"]):
        lines.append(f"  {name:16s} {g['steps']:6d} steps {g['seconds']:8.3f} s {g['seconds'] / total:6.1%} "
                     f"{g['ms_per_step']:8.3f} ms/step  prompt {g['prompt_tokens']} decode {g['decode_tokens']}")
    return "\n".join(lines)
