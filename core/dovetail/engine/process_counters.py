"""What a process spent outside its own work while it ran: to tell a stall's cause from the counts.

A step that takes far longer than the steps around it waited on something: a garbage collection, the
kernel taking the CPU away (involuntary context switches), page faults, or the device allocator giving its
cached memory back and waiting for the device (``alloc_retries``). Each rank reports these
(:meth:`dovetail.engine.worker.Worker.counters`) and the engine's process its own; the difference over a run
says which of them grew (``dovetail bench throughput --step-stats``).

The host's kernel can also hold any process that faults a page in while it compacts or reclaims memory (for a
transparent huge page, say): :func:`host_counters` reads those stalls for the whole host.
"""

from __future__ import annotations

import gc
import resource
from pathlib import Path

#: The host's counts of :func:`host_counters`, by their names in ``/proc/vmstat`` (prefixes are summed).
_VMSTAT = {"compaction_stalls": "compact_stall", "reclaim_stalls": "allocstall_", "huge_page_faults": "thp_fault_alloc"}


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


def host_counters(vmstat: Path = Path("/proc/vmstat")) -> dict[str, float]:
    """The host's memory compaction and reclaim stalls and transparent huge pages faulted in so far (Linux;
    empty elsewhere)."""
    try:
        lines = vmstat.read_text().splitlines()
    except OSError:
        return {}
    counts: dict[str, float] = {}
    for line in lines:
        key, _, value = line.partition(" ")
        for name, prefix in _VMSTAT.items():
            if key == prefix or (prefix.endswith("_") and key.startswith(prefix)):
                counts[name] = counts.get(name, 0) + int(value)
    return counts


def transparent_huge_pages(root: Path = Path("/sys/kernel/mm/transparent_hugepage")) -> str | None:
    """The host's transparent huge page setting and its defrag setting (``"madvise, defrag madvise"``), or None."""
    chosen = []
    for name in ("enabled", "defrag"):
        try:
            text = (root / name).read_text()
        except OSError:
            return None
        start, end = text.find("["), text.find("]")
        chosen.append(text[start + 1:end] if 0 <= start < end else text.strip())
    return f"{chosen[0]}, defrag {chosen[1]}"

