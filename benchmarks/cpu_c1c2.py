"""C1 (offline throughput) and C2 (batch-1 decode latency) of docs/benchmarks.md on the CPU, against HF.

Builds the C1 model (Llama: hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1376,
vocab 32000, float32, random weights) once under ``--model-dir``, then in one process:

- C1: 64 requests (prompt 64-256, output 64-128 tokens, seeded with the round, random token ids,
  ``ignore_eos``) through ``LLM.generate`` after a warm-up call on other prompts; output tokens / wall time. HF
  ``generate`` runs the same requests as one left-padded batch (greedy, ``max_new_tokens`` = the
  longest output); only the tokens each request asked for count.
- C1-like: 32 requests of exactly 160 prompt + 96 output tokens, the shape llama.cpp's
  llama-batched-bench runs (``-npp 160 -ntg 96 -npl 32``); output tokens / wall time.
- C2: one 128-token prompt, 256 output tokens; ms per output token with prefill excluded (from the
  request's first and last token times; for HF, generating 257 tokens minus generating 1).

With ``--llamacpp-bin`` and ``--gguf`` the same run also measures llama.cpp (peer_llamacpp.py). Each
figure is measured ``--repeat`` times, interleaved, with the 1-minute load average before it (the
machine is shared: figures taken under load are not comparable).

Usage::

    python benchmarks/cpu_c1c2.py [--backend CPU_SIMD] [--skip-hf] [--repeat 3] [--threads 2]
        [--llamacpp-bin DIR --gguf C1-F32.gguf]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

C1_SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                intermediate_size=1376, vocab_size=32000, max_position_embeddings=2048)


def build_model(path: Path) -> Path:
    """Save the C1 model with random weights (HF's initialisation, seed 0) unless it exists."""
    if (path / "config.json").is_file():
        return path
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(**C1_SHAPE, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(path))
    return path


def c1_requests(num: int = 64, seed: int = 0) -> list[tuple[list[int], int]]:
    """C1's requests as ``dovetail bench throughput --model c1`` draws them (``--workload-seed`` = ``seed``)."""
    from dovetail.bench.workload import random_requests

    return [(r.prompt_token_ids, r.output_len) for r in random_requests(num, (64, 256), (64, 128), 32000, seed)]


def c1_like_requests(num: int = 32, prompt: int = 160, output: int = 96, seed: int = 0):
    rng = random.Random(seed)
    return [([rng.randrange(2, 32000) for _ in range(prompt)], output) for _ in range(num)]


def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def load_average() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def dovetail_c1(llm, requests) -> float:
    from dovetail import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    llm.generate([{"prompt_token_ids": p[::-1]} for p, _ in requests[:4]], params[:4], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == sum(n for _, n in requests)
    return produced / elapsed


def dovetail_c2(llm, prompt: list[int], output_len: int = 256) -> float:
    from dovetail import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    m = out.metrics
    return (m.last_token_time - m.first_token_time) / (output_len - 1) * 1000


@torch.inference_mode()
def hf_c1(model, requests) -> float:
    longest_prompt = max(len(p) for p, _ in requests)
    longest_output = max(n for _, n in requests)
    ids = torch.zeros(len(requests), longest_prompt, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, _) in enumerate(requests):
        ids[i, longest_prompt - len(p):] = torch.tensor(p)
        mask[i, longest_prompt - len(p):] = 1
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(ids[:2, -16:], attention_mask=mask[:2, -16:], max_new_tokens=4, **kwargs)  # warm-up
    start = time.perf_counter()
    model.generate(ids, attention_mask=mask, max_new_tokens=longest_output, min_new_tokens=longest_output, **kwargs)
    elapsed = time.perf_counter() - start
    return sum(n for _, n in requests) / elapsed


@torch.inference_mode()
def hf_c2(model, prompt: list[int], output_len: int = 256) -> float:
    ids = torch.tensor([prompt])
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(ids, max_new_tokens=4, **kwargs)

    def timed(n):
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        return time.perf_counter() - start

    return (timed(output_len + 1) - timed(1)) / output_len * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default="/tmp/dovetail-c1-model")
    parser.add_argument("--backend", action="append", help="attention backend(s) (default: CPU_SIMD)")
    parser.add_argument("--kv-cache-dtype", default=None, help="e.g. bfloat16 (default: the model's dtype)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all usable)")
    parser.add_argument("--repeat", type=int, default=2, help="measurements of each figure")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-c1", action="store_true")
    parser.add_argument("--skip-c2", action="store_true")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--llamacpp-bin", help="llama.cpp's build/bin (llama-bench, llama-batched-bench)")
    parser.add_argument("--gguf", help="the C1 model as f32 GGUF (peer_llamacpp.py --write-gguf)")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    path = build_model(Path(args.model_dir))
    c2_prompt = random.Random(1).sample(range(2, 32000), 128)
    threads = args.threads or torch.get_num_threads()
    results: dict = {}

    def record(name, measure):
        # Noise: the 1-minute load average before, and the share of `threads` cores this process (and its
        # children, llama.cpp) got while measuring; well below 1 means other work took the cores.
        load = load_average()
        wall, cpu = time.perf_counter(), _cpu_seconds()
        value = measure()
        share = (_cpu_seconds() - cpu) / ((time.perf_counter() - wall) * threads)
        results.setdefault(name, []).append(round(value, 2))
        results.setdefault(name + " (load avg before)", []).append(load)
        results.setdefault(name + " (cpu share)", []).append(round(share, 2))
        print(json.dumps({name: round(value, 2), "load": load, "cpu share": round(share, 2)}), flush=True)

    from dovetail import LLM

    engines = {b: LLM(str(path), attention_backend=b, cpu_threads=args.threads, max_model_len=2048,
                      kv_cache_dtype=args.kv_cache_dtype) for b in args.backend or ["CPU_SIMD"]}
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for repeat in range(args.repeat):
        # Fresh prompts each round: the same prompts again would hit Dovetail's prefix cache.
        requests, like = c1_requests(args.num_requests, seed=repeat), c1_like_requests(seed=repeat)
        for backend, llm in engines.items():
            if not args.skip_c1:
                record(f"{backend} C1 tok/s", lambda: dovetail_c1(llm, requests))
                record(f"{backend} C1-like tok/s", lambda: dovetail_c1(llm, like))
            if not args.skip_c2:
                record(f"{backend} C2 ms/tok", lambda: dovetail_c2(llm, c2_prompt))
        if hf is not None:
            torch.set_num_threads(threads)
            if not args.skip_c2:
                record("HF C2 ms/tok", lambda: hf_c2(hf, c2_prompt))
            if not args.skip_c1:
                record("HF C1 tok/s", lambda: hf_c1(hf, requests))
        if args.llamacpp_bin and args.gguf:
            import peer_llamacpp

            if not args.skip_c2:
                record("llama.cpp C2 ms/tok", lambda: peer_llamacpp.c2_ms_per_token(args.llamacpp_bin, args.gguf,
                                                                                   threads))
            if not args.skip_c1:
                record("llama.cpp C1-like tok/s", lambda: peer_llamacpp.c1_like(args.llamacpp_bin, args.gguf,
                                                                               threads)["output_tok_s"])
    summary = {k: statistics.median(v) for k, v in results.items()}
    print("threads:", threads, "median:", json.dumps(summary))


if __name__ == "__main__":
    main()
