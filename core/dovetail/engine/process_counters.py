"""What a process spent outside its own work while it ran: to tell a stall's cause from the counts.

A step that takes far longer than the steps around it waited on something: a garbage collection, the
kernel taking the CPU away (involuntary context switches), page faults, or the device allocator giving its
cached memory back and waiting for the device (``alloc_retries``). Each rank reports these
(:meth:`dovetail.engine.worker.Worker.counters`) and the engine's process its own; the difference over a run
says which of them grew (``dovetail bench throughput --step-stats``).
"""

from __future__ import annotations

import gc
import resource


def process_counters() -> dict[str, float]:
    """This process's garbage collections, context switches, page faults and CPU seconds so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"gc_collections": sum(generation["collections"] for generation in gc.get_stats()),
            "involuntary_switches": usage.ru_nivcsw, "voluntary_switches": usage.ru_nvcsw,
            "minor_faults": usage.ru_minflt, "major_faults": usage.ru_majflt,
            "cpu_s": usage.ru_utime + usage.ru_stime}


def counters_since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """``after`` less ``before`` for each count both have."""
    return {name: after[name] - before[name] for name in after if name in before}
