"""Where a throughput run's wall time goes, step by step: ``dovetail bench throughput --step-stats``.

The scheduler's batches and the times ``LLMEngine.step`` returns are recorded in the bench's process only
(nothing is added to the engine's own path). With overlapped scheduling a step returns once the step
*before* it has finished on the devices, so the time between two returns is charged to the batch launched
by the first of them; when the devices are the bottleneck that is the batch's device time.

Steps are grouped into those with prompt tokens (prefill, possibly with decodes beside them) and decode-only
steps by their number of sequences, so a run's time can be set against each group's bound (weights read
once a step, the KV cache read by attention).

Stalls: a decode step that takes much longer than the decode steps around it (whose batches barely differ)
waited on something other than its own work, such as the host (a garbage collection, an allocation) or a
peer rank. ``stalls`` counts the decode steps over ``STALL_RATIO`` times the median of their neighbours,
their time beyond that median, and the longest of them, with when they ended (``time.perf_counter``, so they
can be matched with other logs of the host), without a profiler, whose own work adds stalls. ``counters``
then says what grew in each process over the run (:mod:`dovetail.engine.process_counters`): the engine's and
each rank's collections, involuntary context switches and page faults, and each rank's device allocator
retries, each of which waits for the device, and the host's memory compaction and reclaim stalls, which hold
whichever process faults a page in meanwhile. Each listed stall also names, for the engine's process and each
rank, the longest gap between two of its marks within the stall (:mod:`dovetail.engine.step_timeline`), which
says whom the step waited for; the engine's marks are its scheduling (``schedule`` to ``scheduled``), its
sending a step (``send`` to ``sent``), its wait for the output of the step before (``take`` to ``taken``) and
the step's return (``returned``).
"""

from __future__ import annotations

import contextlib
import statistics
import time

from dovetail.engine.process_counters import counters_since, host_counters, process_counters, transparent_huge_pages
from dovetail.engine.step_timeline import StepTimeline, longest_gap

#: Upper edges of the decode-only groups, by sequences in the step.
DECODE_GROUPS = (1, 8, 32, 64, 128, 192, 256, 512, 1024)
#: A decode step is a stall above this multiple of the median of the ``STALL_NEIGHBOURS`` decode steps on
#: either side of it.
STALL_RATIO = 1.5
STALL_NEIGHBOURS = 8
#: How many of the longest stalls the summary lists.
STALLS_LISTED = 10


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
    timeline = StepTimeline()

    def recording_schedule():
        timeline.mark("schedule")
        batch = schedule()
        timeline.mark("scheduled")
        if batch:
            decodes = sum(1 for n in batch.num_new_tokens if n == 1)
            launched.append((len(batch.requests), batch.total_tokens - decodes, decodes))
        else:
            launched.append((0, 0, 0))
        return batch

    def recording_step():
        outputs = step()
        returns.append(time.perf_counter())
        timeline.mark("returned")
        return outputs

    executor = engine.executor
    execute_model, take_output = executor.execute_model, executor.take_output

    def recording_execute_model(step_description):
        timeline.mark("send")
        execute_model(step_description)
        timeline.mark("sent")

    def recording_take_output():
        timeline.mark("take")
        output = take_output()
        timeline.mark("taken")
        return output

    ranks_before, engine_before, host_before = executor.collective_rpc("counters"), process_counters(), host_counters()
    executor.collective_rpc("start_timeline")
    timeline.start()
    scheduler.schedule, engine.step = recording_schedule, recording_step
    executor.execute_model, executor.take_output = recording_execute_model, recording_take_output
    start = time.perf_counter()
    try:
        yield summary
    finally:
        del scheduler.schedule, engine.step, executor.execute_model, executor.take_output  # the class's methods
        engine_marks = timeline.stop()
        summary.update(summarize(launched, returns, start, engine.overlap))
    # Only after a run that ended well: a failed engine's ranks answer no more calls.
    explain_stalls(summary["stalls"]["longest"], engine_marks, executor.collective_rpc("stop_timeline"))
    summary["counters"] = {
        "host": counters_since(host_before, host_counters()), "transparent_huge_pages": transparent_huge_pages(),
        "engine": counters_since(engine_before, process_counters()),
        "ranks": [counters_since(b, a) for b, a in zip(ranks_before, executor.collective_rpc("counters"))]}


def summarize(launched: list[tuple[int, int, int]], returns: list[float], start: float, overlap: bool) -> dict:
    """Charge each interval between step returns to its batch (the one launched a step earlier under
    overlap) and sum them by group."""
    marks = [start] + returns
    groups: dict[str, dict] = {}
    decodes: list[tuple[int, int, float, float]] = []  # (step, sequences, seconds, end) of decode-only steps
    shift = 1 if overlap else 0
    for i in range(len(returns) - shift):
        seqs, prompt_tokens, decode_tokens = launched[i] if i < len(launched) else (0, 0, 0)
        if seqs == 0:
            continue
        seconds = marks[i + 1 + shift] - marks[i + shift]
        if not prompt_tokens:
            decodes.append((i, seqs, seconds, marks[i + 1 + shift]))
        name = "prefill" if prompt_tokens else _group(seqs)
        g = groups.setdefault(name, {"steps": 0, "seconds": 0.0, "prompt_tokens": 0, "decode_tokens": 0})
        g["steps"] += 1
        g["seconds"] += seconds
        g["prompt_tokens"] += prompt_tokens
        g["decode_tokens"] += decode_tokens
    for g in groups.values():
        g["ms_per_step"] = 1e3 * g["seconds"] / g["steps"]
    total = marks[-1] - start
    return {"seconds": total, "steps": sum(g["steps"] for g in groups.values()), "groups": groups,
            "stalls": stalls(decodes)}


def stalls(decodes: list[tuple[int, int, float, float]]) -> dict:
    """The decode steps over ``STALL_RATIO`` times their neighbours' median: how many, their time beyond
    it, and the longest."""
    found = []
    for j, (step, seqs, seconds, end) in enumerate(decodes):
        around = [d[2] for d in decodes[max(0, j - STALL_NEIGHBOURS):j] + decodes[j + 1:j + 1 + STALL_NEIGHBOURS]]
        if not around:
            continue
        usual = statistics.median(around)
        if seconds > STALL_RATIO * usual:
            found.append({"step": step, "sequences": seqs, "ms": 1e3 * seconds, "usual_ms": 1e3 * usual,
                          "ended_at": end})
    found.sort(key=lambda f: f["usual_ms"] - f["ms"])
    return {"steps": len(found), "extra_seconds": sum(f["ms"] - f["usual_ms"] for f in found) / 1e3,
            "longest": found[:STALLS_LISTED]}


def explain_stalls(longest: list[dict], engine_marks: list, rank_marks: list[list]) -> None:
    """Add to each stall the longest gap between two marks of each process within it (``waits`` maps ``engine``
    and ``rank R`` to (from, to, ms)) and every process's marks within it (``marks``: the same keys, each a list
    of (name, ms since the stall began))."""
    for stall in longest:
        end = stall["ended_at"]
        begin = end - stall["ms"] / 1e3
        waits, within = {}, {}
        for name, marks in [("engine", engine_marks)] + [(f"rank {r}", m) for r, m in enumerate(rank_marks)]:
            gap = longest_gap(marks, begin, end)
            if gap is not None:
                waits[name] = (gap[0], gap[1], round(1e3 * gap[2], 2))
            within[name] = [(mark, round(1e3 * (t - begin), 2)) for mark, t in marks if begin <= t <= end]
        stall["waits"], stall["marks"] = waits, within


def format_summary(summary: dict) -> str:
    """A few lines for the log: each group's steps, seconds, share and milliseconds a step."""
    total = summary["seconds"] or 1.0
    lines = [f"{summary['steps']} steps in {summary['seconds']:.2f} s"]
    for name, g in sorted(summary["groups"].items(), key=lambda kv: -kv[1]["seconds"]):
        lines.append(f"  {name:16s} {g['steps']:6d} steps {g['seconds']:8.3f} s {g['seconds'] / total:6.1%} "
                     f"{g['ms_per_step']:8.3f} ms/step  prompt {g['prompt_tokens']} decode {g['decode_tokens']}")
    stalled = summary.get("stalls")
    if stalled and stalled["steps"]:
        lines.append(f"  stalls: {stalled['steps']} decode steps over {STALL_RATIO}x their neighbours' median, "
                     f"{1e3 * stalled['extra_seconds']:.1f} ms beyond it; the longest: " + ", ".join(
                         f"step {f['step']} ({f['sequences']} seqs) {f['ms']:.1f} ms, usually {f['usual_ms']:.1f}"
                         for f in stalled["longest"][:3]))
        for f in stalled["longest"][:3]:
            if f.get("waits"):
                lines.append(f"    step {f['step']} waited: " + "; ".join(
                    f"{who} {a} to {b} {ms:.1f} ms" for who, (a, b, ms) in f["waits"].items()))
    counted = summary.get("counters")
    if counted:
        host = ", ".join(_counts_in_words(counted["host"], _HOST_WORDS))
        if host or counted.get("transparent_huge_pages"):
            lines.append(f"  host: {host or 'no memory counts'} (transparent huge pages: "
                         f"{counted.get('transparent_huge_pages') or 'unknown'})")
        lines.append(f"  engine process: {_format_counters(counted['engine'])}")
        lines.extend(f"  rank {rank}: {_format_counters(c)}" for rank, c in enumerate(counted["ranks"]))
    return "\n".join(lines)


_HOST_WORDS = (("compaction_stalls", "memory compaction stalls"), ("reclaim_stalls", "memory reclaim stalls"),
               ("huge_page_faults", "huge pages faulted in"))
_COUNTER_WORDS = (("gc_collections", "collections"), ("involuntary_switches", "involuntary switches"),
                  ("minor_faults", "minor faults"), ("major_faults", "major faults"),
                  ("alloc_retries", "allocator retries"), ("device_allocs", "device allocations"),
                  ("device_frees", "device frees"), ("host_allocs", "pinned host allocations"))


def _counts_in_words(counts: dict[str, float], words: tuple[tuple[str, str], ...]) -> list[str]:
    return [f"{counts[name]:,.0f} {word}" for name, word in words if name in counts]


def _format_counters(counters: dict[str, float]) -> str:
    words = _counts_in_words(counters, _COUNTER_WORDS)
    if "host_alloc_us" in counters:
        words.append(f"{counters['host_alloc_us'] / 1e3:.1f} ms making them")
    if "cpu_s" in counters:
        words.append(f"{counters['cpu_s']:.2f} CPU s")
    return ", ".join(words)
