"""HF transformers ``generate`` as the peer, on the same shape in the same process."""

from __future__ import annotations

import time

import torch

from dovetail.bench.workload import BenchRequest


def load_hf_model(model_dir: str, dtype: str, device: str, dummy: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype) if dtype and dtype != "auto" else "auto"
    if dummy:
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device(device):  # random weights drawn where they will run
            model = AutoModelForCausalLM.from_config(config, dtype=None if torch_dtype == "auto" else torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    return model.to(device).eval()


def _sync(device: str):
    if torch.device(device).type != "cpu":
        torch.accelerator.synchronize()


@torch.inference_mode()
def hf_throughput(model, requests: list[BenchRequest], batch_size: int, device: str) -> dict:
    """Padded batches of ``batch_size``; counts each request's own output length."""
    pad = 0
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        chunk = requests[start:start + batch_size]
        width = max(len(r.prompt_token_ids) for r in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(chunk):
            ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids):] = 1
        new = max(r.output_len for r in chunk)
        model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, eos_token_id=None, pad_token_id=pad)
    _sync(device)
    elapsed = time.perf_counter() - t0
    output_tokens = sum(r.output_len for r in requests)
    return {"output_tokens": output_tokens, "seconds": elapsed, "output_tokens_per_s": output_tokens / elapsed,
            "batch_size": batch_size}


@torch.inference_mode()
def hf_latency(model, prompt_ids: list[int], output_len: int, device: str) -> dict:
    """Milliseconds per output token at batch 1, prefill excluded."""
    ids = torch.tensor([prompt_ids], device=device)

    def run(n):
        _sync(device)
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        _sync(device)
        return time.perf_counter() - t

    run(2)
    first = run(1)
    full = run(output_len)
    return {"ms_per_token": (full - first) / (output_len - 1) * 1000, "prefill_ms": first * 1000}
