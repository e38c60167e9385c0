"""B1 step by step: how long each engine step keeps the GPU, split into attention, matrix products and the
rest, by decode batch size, with the KV-cache bandwidth the attention reaches.

    python3 benchmarks/h200_b1_steps.py [--model llama-3.1-8b] [--num 256]

The engine runs as ``dovetail bench throughput`` does (CUDA graphs, overlapped scheduling, TRITON) under
``torch.profiler`` (CUDA activity). Before every step the script launches a one-cycle marker kernel
(``torch.cuda._sleep``) and notes the step's shape (sequences, tokens, summed context); the markers cut
the kernel timeline into steps. A step's time runs from its marker to the next one. Prints a table by
decode batch size (prefill steps apart) and writes ``$OUT/b1_steps_<model>.json`` with every step.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from h200_b1_gaps import gpu_intervals  # benchmarks/, this script's directory
from h200_profile_decode import b1_script_setup, group_of, profiled_b1


MARKER = "spin_kernel"


def record_steps(llm, num: int):
    """(trace spans, per-step shapes, wall seconds) of one B1 ``generate`` (``profiled_b1``) with a marker
    before each step. The warm-up's steps are noted too, first; only the profiled ones leave markers."""
    runner = llm.llm_engine.runner
    shapes_seen: list[dict] = []
    execute = runner.execute

    def marked(batch, tables, *args, **kwargs):
        torch.cuda._sleep(1)
        shapes_seen.append({"seqs": len(batch.requests), "tokens": batch.total_tokens,
                            "context": sum(r.num_computed_tokens + n for r, n in zip(batch.requests, batch.num_new_tokens)),
                            "decode_only": all(n == 1 for n in batch.num_new_tokens)})
        return execute(batch, tables, *args, **kwargs)

    runner.execute = marked
    try:
        prof, wall, _ = profiled_b1(llm, num)
    finally:
        runner.execute = execute
    trace = Path("/tmp/b1_steps_trace.json")
    prof.export_chrome_trace(str(trace))
    return gpu_intervals(trace), shapes_seen, wall


def split_steps(spans, shapes_seen) -> list[dict]:
    """The profiled steps, each its shape (the last of ``shapes_seen``: the warm-up's come first) with its time
    and its kernel time by group."""
    marks = [i for i, (_, _, name) in enumerate(spans) if MARKER in name]
    if len(marks) > len(shapes_seen):
        raise SystemExit(f"{len(marks)} markers in the trace for {len(shapes_seen)} steps")
    shapes_seen = shapes_seen[len(shapes_seen) - len(marks):]
    steps = []
    for j, first in enumerate(marks):
        last = marks[j + 1] if j + 1 < len(marks) else len(spans)
        groups = defaultdict(float)
        for s, e, name in spans[first + 1:last]:
            groups[group_of(name)] += e - s
        end = spans[last][0] if last < len(spans) else max(e for _, e, _ in spans[first:last])
        steps.append({**shapes_seen[j], "us": end - spans[first][0], **groups})
    return steps


def summarize(steps: list[dict], kv_bytes_per_token: int) -> list[dict]:
    buckets = defaultdict(list)
    for step in steps:
        key = "prefill" if not step["decode_only"] else f"{(step['seqs'] - 1) // 32 * 32 + 1}-{(step['seqs'] - 1) // 32 * 32 + 32}"
        buckets[key].append(step)
    rows = []
    for key, group in sorted(buckets.items(), key=lambda kv: (kv[0] != "prefill", int(kv[0].split("-")[0]) if kv[0] != "prefill" else 0)):
        total = lambda field: sum(s.get(field, 0.0) for s in group) / 1e6  # noqa: E731
        kv = sum(s["context"] for s in group) * kv_bytes_per_token
        rows.append({"batch": key, "steps": len(group), "s": total("us"), "attention_s": total("attention"),
                     "matmul_s": total("matmul"), "rest_s": total("norm, rotary, activation, KV write") + total("other"),
                     "kv_TBps": kv / total("attention") / 1e12 if total("attention") else 0.0})
    return rows


def main() -> None:
    args, out, llm = b1_script_setup("llama-3.1-8b", 256)
    spans, shapes_seen, wall = record_steps(llm, args.num)
    steps = split_steps(spans, shapes_seen)
    runner = llm.llm_engine.runner
    rows = summarize(steps, runner.bytes_per_block() // runner.block_size)
    print(f"{args.model} B1 x{args.num} under the profiler: wall {wall:.2f} s, steps {len(steps)}, "
          f"summed step time {sum(s['us'] for s in steps) / 1e6:.2f} s")
    print(f"{'batch':>9} {'steps':>5} {'s':>7} {'attn s':>7} {'mm s':>7} {'rest s':>7} {'idle s':>7} {'KV TB/s':>7}")
    for r in rows:
        idle = r["s"] - r["attention_s"] - r["matmul_s"] - r["rest_s"]
        print(f"{r['batch']:>9} {r['steps']:5d} {r['s']:7.3f} {r['attention_s']:7.3f} {r['matmul_s']:7.3f} "
              f"{r['rest_s']:7.3f} {idle:7.3f} {r['kv_TBps']:7.2f}")
    (out / f"b1_steps_{args.model}.json").write_text(json.dumps({"wall_s": wall, "rows": rows, "steps": steps}))


if __name__ == "__main__":
    main()
