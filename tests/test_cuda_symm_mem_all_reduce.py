"""``DOVETAIL_ALL_REDUCE=symm_mem`` (what ``auto`` picks over NVLink) on two NVIDIA GPUs: torch symmetric
memory's one- and two-shot all-reduces against NCCL's, inside a CUDA graph too, and the engine's greedy tokens
with them (GPU)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from spmd import cuda_tensor_parallel_rank, free_port

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two NVIDIA GPUs")]

#: Elements at two ranks: one-shot (2 KiB, 128 KiB), two-shot (2 MiB), and beyond the buffer (NCCL's).
SIZES = (1024, 65536, 1 << 20, 32 << 20)


def _rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from dovetail import distributed
    from dovetail_cuda.symm_mem_all_reduce import SymmMemAllReduce, all_reduce_kernel

    with cuda_tensor_parallel_rank(rank, 2, port) as device:
        kernel = SymmMemAllReduce(distributed.tp_group(), device)
        out = {}
        for size in SIZES:
            x = torch.randn(size, generator=torch.Generator().manual_seed(rank * 100 + size)).to(device,
                                                                                              torch.bfloat16)
            expected = x.clone()
            dist.all_reduce(expected)
            got = x.clone()
            took = kernel(got)
            out[size] = (took, bool(torch.equal(got, expected)) if took else None,
                         float((got.float() - expected.float()).abs().max()))
        y = torch.zeros(4096, device=device, dtype=torch.bfloat16)
        kernel(y.clone())  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kernel(y)
        y.copy_(torch.full_like(y, rank + 1.0))
        graph.replay()
        torch.cuda.synchronize()
        out["graph"] = float(y.float().min()), float(y.float().max())
        os.environ.pop("DOVETAIL_ALL_REDUCE", None)
        from dovetail_cuda.flashinfer_all_reduce import load_fused_kernels

        out["fused_kernels"] = load_fused_kernels(compile=False) is None  # built already: auto takes them
        out["auto"] = type(all_reduce_kernel(distributed.tp_group(), device)).__name__
        results[rank] = out


def test_symmetric_memory_all_reduce_matches_nccl_and_replays_in_a_graph():
    results = mp.Manager().dict()
    mp.start_processes(_rank, args=(free_port(), results), nprocs=2, start_method="spawn")
    for rank in range(2):
        out = results[rank]
        for size in SIZES[:-1]:
            took, equal, diff = out[size]
            assert took, f"{size} bfloat16 elements fit the buffer"
            assert diff <= 2 ** -6 * 8, f"{size} elements: differs from NCCL by {diff}"
        assert out[SIZES[-1]][0] is False, "a message beyond the buffer goes to NCCL"
        assert out["graph"] == (3.0, 3.0), "the captured all-reduce summed the replayed values (1 + 2)"
        expected = "FlashInferFusedAllReduce" if out["fused_kernels"] else "SymmMemAllReduce"
        assert out["auto"] == expected, ("DOVETAIL_ALL_REDUCE=auto takes symmetric memory over NVLink (fused with "
                                         "the norms where FlashInfer's kernels are built)")


def test_engine_greedy_with_symmetric_memory_all_reduce(tmp_path, monkeypatch):
    """bfloat16 at TP=2: the symmetric-memory all-reduce gives NCCL's tokens exactly (with two ranks each sum
    is one addition, rounded once, whichever kernel makes it), and NCCL's follow HF's float32 ones up to a
    near tie (0.1 nats: bfloat16 logits carry about three significant digits)."""
    from dovetail import LLM, SamplingParams
    from test_models_vs_hf import save_checkpoint
    from tiny_models import assert_greedy_matches, hf_greedy, load_hf, tiny_llama_config

    path = save_checkpoint(tmp_path, tiny_llama_config(hidden_size=512, intermediate_size=512,
                                                       num_attention_heads=4, num_key_value_heads=2))
    prompts = [[5, 6, 7, 8, 9, 10], list(range(20, 61)), [42] * 33]
    hf = load_hf(path)
    references = [hf_greedy(hf, p, 16) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine = dict(device="cuda", dtype="bfloat16", tensor_parallel_size=2, gpu_memory_utilization=0.3,
                  max_model_len=256, max_num_seqs=8)
    tokens = {}
    for choice in ("nccl", "symm_mem"):
        monkeypatch.setenv("DOVETAIL_ALL_REDUCE", choice)
        llm = LLM(str(path), **engine)
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            tokens[choice] = [o.outputs[0].token_ids for o in outputs]
        finally:
            llm.llm_engine.shutdown()
    assert tokens["symm_mem"] == tokens["nccl"]
    for ours, (hf_tokens, hf_logprobs) in zip(tokens["nccl"], references):
        assert_greedy_matches(ours, hf_tokens, hf_logprobs, tol=0.1)
