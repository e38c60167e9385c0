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


#: Elements at two ranks for the copy-engine sum: taken (from 256 KiB on), below its floor, not a multiple of
#: 16, and one that grows its buffers past their first 16 MiB.
COPY_SIZES = (1 << 17, 1 << 16, (1 << 17) + 8, 12 << 20)


def _copy_engine_rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from dovetail import distributed
    from dovetail_cuda.copy_engine_all_reduce import CopyEngineAllReduce

    with cuda_tensor_parallel_rank(rank, 2, port) as device:
        kernel = CopyEngineAllReduce(distributed.tp_group(), device, min_bytes=256 << 10)
        gen = torch.Generator().manual_seed(rank)
        out = {}
        for size in COPY_SIZES:
            x = torch.randn(size, generator=gen).to(device, torch.bfloat16)
            expected = x.clone()
            dist.all_reduce(expected)
            took = kernel(x)
            out[size] = (took, bool(torch.equal(x, expected)) if took else None)
        # Two micro-batches' sums issued in turns from two streams, each stream busy before its sum.
        streams = [torch.cuda.current_stream(device), torch.cuda.Stream(device)]
        parts = [torch.randn(3 << 18, generator=gen).to(device, torch.bfloat16) for _ in range(4)]
        wanted = [p.clone() for p in parts]
        for w in wanted:
            dist.all_reduce(w)
        streams[1].wait_stream(streams[0])
        for turn, part in enumerate(parts):
            with torch.cuda.stream(streams[turn % 2]):
                torch.cuda._sleep(1_000_000 * (turn % 2))
                kernel(part)
        torch.cuda.synchronize()
        out["turns"] = [bool(torch.equal(p, w)) for p, w in zip(parts, wanted)]
        results[rank] = out


def test_copy_engine_all_reduce_matches_nccl_from_two_streams():
    """``DOVETAIL_LARGE_ALL_REDUCE=copy_engine``'s sum: NCCL's to the bit at two ranks (one bfloat16 addition
    each), messages it does not take left alone, and sums issued in turns from two streams (dual-batch
    overlap) each right."""
    results = mp.Manager().dict()
    mp.start_processes(_copy_engine_rank, args=(free_port(), results), nprocs=2, start_method="spawn")
    for rank in range(2):
        out = results[rank]
        assert out[COPY_SIZES[0]] == (True, True) and out[COPY_SIZES[3]] == (True, True)
        assert out[COPY_SIZES[1]] == (False, None), "below the floor: the backend's"
        assert out[COPY_SIZES[2]] == (False, None), "not a multiple of 16 elements: the backend's"
        assert out["turns"] == [True] * 4

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


def test_engine_greedy_with_copy_engine_all_reduce(tmp_path, monkeypatch):
    """bfloat16 at TP=2 with ``DOVETAIL_LARGE_ALL_REDUCE=copy_engine``: NCCL's tokens exactly (two ranks' sums
    are one addition either way), in whole steps (a step of 6,165 tokens of hidden 3,072 sums 36 MiB, beyond the
    symmetric buffer's 32), in two micro-batches (parts of about 3,000 tokens, 18 MiB, above the copy-engine
    sum's floor of 8) and with the row-parallel outputs summed in three chunks (12 MiB each) started one after
    another (``DOVETAIL_ROW_REDUCE_CHUNKS``)."""
    from dovetail import LLM, SamplingParams
    from test_models_vs_hf import save_checkpoint
    from tiny_models import tiny_llama_config

    path = save_checkpoint(tmp_path, tiny_llama_config(hidden_size=3072, intermediate_size=3072, vocab_size=512,
                                                       num_attention_heads=24, num_key_value_heads=8,
                                                       max_position_embeddings=2048))
    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(1000 + 11 * i)]} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = dict(device="cuda", dtype="bfloat16", tensor_parallel_size=2, gpu_memory_utilization=0.3,
                  max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=8192)
    monkeypatch.setenv("DOVETAIL_ALL_REDUCE", "symm_mem")
    tokens = {}
    for way in ("whole", "micro-batches", "chunks"):
        for large in ("nccl", "copy_engine"):
            monkeypatch.setenv("DOVETAIL_LARGE_ALL_REDUCE", large)
            monkeypatch.setenv("DOVETAIL_ROW_REDUCE_CHUNKS", "3" if way == "chunks" else "0")
            llm = LLM(str(path), enable_dbo=way == "micro-batches", dbo_prefill_token_threshold=4096, **engine)
            try:
                outputs = llm.generate(prompts, params, use_tqdm=False)
                tokens[way, large] = [o.outputs[0].token_ids for o in outputs]
            finally:
                llm.llm_engine.shutdown()
        assert tokens[way, "copy_engine"] == tokens[way, "nccl"], way
