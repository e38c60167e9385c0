"""An upper bound on C1 throughput on this CPU: the time of C1's matrix products alone.

C1 (docs/benchmarks.md) runs 64 requests of the C1 model. Whatever the attention backend, every prompt token
and every fed-back output token goes through each layer's seven linears, and every sampled row through the
LM head. This replays exactly those products, with the engine's own request set: prompts in prefill chunks
of ``--chunk`` tokens, then one decode step per output position over the requests still running. It leaves
out attention, norms, rotary, sampling and all host work, so no engine can finish C1 faster here.

Each product runs through the CPU platform's ``linear`` (what the engine calls) and through ``F.linear``,
and the faster is counted. A second, tighter bound adds the time to read, once, the cached keys and values that
decode attention must see (every earlier token of its request, float32 as C1's ``kv_cache_dtype="auto"``) at the
memory read bandwidth measured here (a ``sum`` over 512 MB). ``--hf`` also runs HF transformers' C1 in the
same process, to set the bounds beside the issue's goal (3x HF).

    python benchmarks/cpu_c1_bound.py --threads 2 --hf
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def products(config) -> list[tuple[int, int]]:
    """(out, in) of one layer's linears: q, k, v, o, gate, up, down."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head = hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head
    return [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden),
            (hidden, inter)]


def steps(requests, chunk: int) -> list[tuple[int, int]]:
    """(rows through the layers, rows through the LM head) of each step: prompt chunks, then decodes."""
    prompt_rows = sum(len(r.prompt_token_ids) for r in requests)
    out = [(min(chunk, prompt_rows - s), 0) for s in range(0, prompt_rows, chunk)]
    out[-1] = (out[-1][0], len(requests))  # every request samples its first token from its prompt
    for t in range(1, max(r.output_len for r in requests)):
        running = sum(1 for r in requests if r.output_len > t)
        out.append((running, running))
    return out


def kv_bytes_read(config, requests, dtype_bytes: int = 4) -> int:
    """Cached key/value bytes the decode steps attend over: output position t of a request sees prompt + t tokens."""
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head * dtype_bytes
    return per_token * sum(len(r.prompt_token_ids) * (r.output_len - 1) + r.output_len * (r.output_len - 1) // 2
                           for r in requests)


def read_bandwidth(repeat: int = 5) -> float:
    """Bytes per second of a multi-threaded read of 512 MB (torch's ``sum``), the best of ``repeat``."""
    data = torch.randn(2**27)
    data.sum()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * data.element_size() / best


def time_products(linear, config, plan, seed: int = 0) -> float:
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(n, k, generator=gen) for n, k in products(config)]
    head = torch.randn(config.vocab_size, config.hidden_size, generator=gen)
    inputs = {k: torch.randn(max(m for m, _ in plan), k, generator=gen) for _, k in products(config)}
    total = 0.0
    for rows, sampled in plan:
        start = time.perf_counter()
        for _ in range(config.num_hidden_layers):
            for w in weights:
                linear(inputs[w.shape[1]][:rows], w)
        if sampled:
            linear(inputs[config.hidden_size][:sampled], head)
        total += time.perf_counter() - start
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=8192, help="prefill tokens per step")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hf", action="store_true", help="run HF transformers' C1 in the same process")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from dovetail.bench.shapes import SHAPES
    from dovetail.bench.throughput import DEFAULTS
    from dovetail.bench.workload import parse_range, random_requests
    from dovetail_cpu.platform import CpuPlatform

    num, prompt_range, output_range, hf_batch = DEFAULTS["c1"]
    config = SHAPES["c1"].config()
    requests = random_requests(num, parse_range(prompt_range), parse_range(output_range), config.vocab_size)
    plan = steps(requests, args.chunk)
    engine_linear = CpuPlatform().fused_ops().linear
    output_tokens = sum(r.output_len for r in requests)
    with torch.inference_mode():
        seconds = {name: min(time_products(fn, config, plan) for _ in range(args.repeat))
                   for name, fn in (("platform linear", engine_linear), ("F.linear", torch.nn.functional.linear))}
    best = min(seconds.values())
    kv_bytes, bandwidth = kv_bytes_read(config, requests), read_bandwidth()
    with_kv = best + kv_bytes / bandwidth
    result = {"threads": args.threads, "steps": len(plan), "output_tokens": output_tokens,
              "products_seconds": {k: round(v, 3) for k, v in seconds.items()},
              "bound_output_tok_s": round(output_tokens / best, 1),
              "kv_read_gb": round(kv_bytes / 1e9, 2), "read_gb_s": round(bandwidth / 1e9, 1),
              "bound_with_kv_reads_output_tok_s": round(output_tokens / with_kv, 1)}
    if args.hf:
        from dovetail.bench.hf_peer import hf_throughput, load_hf_model
        from dovetail.bench.shapes import materialize

        model = load_hf_model(materialize("c1")[0], "float32", "cpu", True)
        hf_throughput(model, requests[:2], 2, "cpu")
        hf = hf_throughput(model, requests, hf_batch, "cpu")["output_tokens_per_s"]
        result.update(hf_output_tok_s=round(hf, 1), goal_3x_hf=round(3 * hf, 1),
                      bound_over_hf=round(output_tokens / best / hf, 2),
                      bound_with_kv_reads_over_hf=round(output_tokens / with_kv / hf, 2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
