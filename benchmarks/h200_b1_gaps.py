"""Where the H200 idles during B1: the GPU timeline of one ``LLM.generate`` as the benchmark runs it.

    python3 benchmarks/h200_b1_gaps.py [--model llama-3.1-8b] [--num 128]

CUDA graphs and overlapped scheduling on (the engine's defaults), TRITON, under ``torch.profiler`` (CUDA
activity only: kernels inside graphs are recorded one by one). Prints the wall time, the time from the first
kernel's start to the last one's end, the union of kernel and copy intervals (busy), the idle gaps by size,
and the kernel pairs around the largest idle totals. Writes ``$OUT/b1_gaps_<model>.json``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from h200_profile_decode import b1_script_setup, profiled_b1  # benchmarks/, this script's directory


def gpu_intervals(trace_path: Path) -> list[tuple[float, float, str]]:
    events = json.loads(trace_path.read_text())["traceEvents"]
    spans = [(e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
             if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X"]
    return sorted(spans)


def main() -> None:
    args, out, llm = b1_script_setup("llama-3.1-8b", 128)
    prof, wall, _ = profiled_b1(llm, args.num)
    trace = Path("/tmp/b1_trace.json")
    prof.export_chrome_trace(str(trace))
    spans = gpu_intervals(trace)
    busy, idle, end = 0.0, [], spans[0][0]
    prev_name = spans[0][2]
    for s, e, name in spans:
        if s > end:
            idle.append((s - end, prev_name, name))
        if e > end:
            busy += e - max(s, end)
            end, prev_name = e, name
    span = end - spans[0][0]
    sizes = defaultdict(lambda: [0, 0.0])
    for gap, _, _ in idle:
        bucket = next(b for b in (5, 20, 100, 1000, 1e12) if gap < b)
        sizes[bucket][0] += 1
        sizes[bucket][1] += gap
    pairs = defaultdict(lambda: [0, 0.0])
    for gap, before, after in idle:
        if gap >= 5:
            pairs[(before[:60], after[:60])][0] += 1
            pairs[(before[:60], after[:60])][1] += gap
    top = sorted(pairs.items(), key=lambda kv: -kv[1][1])[:12]
    report = {"model": args.model, "requests": args.num, "wall_s": wall, "span_s": span / 1e6, "busy_s": busy / 1e6,
              "idle_s": sum(g for g, _, _ in idle) / 1e6,
              "idle_by_size_us": {f"<{b:g}": {"gaps": n, "s": t / 1e6} for b, (n, t) in sorted(sizes.items())},
              "idle_pairs": [{"before": b, "after": a, "gaps": n, "s": t / 1e6} for (b, a), (n, t) in top]}
    print(f"{args.model} B1 x{args.num} under the profiler: wall {wall:.2f} s, GPU span {span / 1e6:.2f} s, busy "
          f"{busy / 1e6:.2f} s, idle {report['idle_s']:.2f} s")
    for bucket, row in report["idle_by_size_us"].items():
        print(f"  gaps {bucket:>6} us: {row['gaps']:7d}  {row['s']:.3f} s")
    for row in report["idle_pairs"]:
        print(f"  {row['s']:.3f} s {row['gaps']:6d} gaps  {row['before']}  ->  {row['after']}")
    (out / f"b1_gaps_{args.model}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
