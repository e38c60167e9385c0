"""``DOVETAIL_ALL_REDUCE=flashinfer`` on two NVIDIA GPUs: FlashInfer's all-reduce fused with the residual add and
RMSNorm against NCCL's all-reduce followed by the engine's add-and-norm, eagerly and replayed from a CUDA graph,
and the engine's greedy tokens with it (GPU)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.multiprocessing as mp

from spmd import cuda_tensor_parallel_rank, free_port

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two NVIDIA GPUs")]

#: (tokens, hidden): one decode token, a few, a full decode batch, Qwen3-32B's width, and one past the limit.
SHAPES = ((1, 4096), (7, 4096), (256, 4096), (3, 5120), (2048, 4096))
#: FlashInfer's choice of algorithm, and each forced.
ONE_SHOT = (None, True, False)


def _reference(x, residual, weight, eps):
    from dovetail.triton.fused_ops import TritonFusedOps

    return TritonFusedOps().add_rms_norm(x, residual, weight, eps)


def _rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from dovetail import distributed
    from dovetail_cuda.flashinfer_all_reduce import FlashInferFusedAllReduce

    with cuda_tensor_parallel_rank(rank, 2, port) as device:
        kernels = {one_shot: FlashInferFusedAllReduce(distributed.tp_group(), device, one_shot=one_shot)
                   for one_shot in ONE_SHOT}
        kernel = kernels[None]
        out = {}
        for (tokens, hidden), one_shot in itertools.product(SHAPES, ONE_SHOT):
            gen = torch.Generator().manual_seed(rank * 1000 + tokens)
            x = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16)
            residual = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).to(
                device, torch.bfloat16)
            weight = (1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(hidden))).to(
                device, torch.bfloat16)
            summed_x = x.clone()
            dist.all_reduce(summed_x)
            want_normed, want_summed = _reference(summed_x, residual, weight, 1e-6)
            got = kernels[one_shot].add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
            if got is None:
                out[(tokens, hidden), one_shot] = None
                continue
            out[(tokens, hidden), one_shot] = (float((got[0].float() - want_normed.float()).abs().max()),
                                     float((got[1].float() - want_summed.float()).abs().max()),
                                     float(want_normed.float().abs().max()))
        x = torch.zeros(4, 4096, device=device, dtype=torch.bfloat16)
        residual, weight = torch.ones_like(x), torch.ones(4096, device=device, dtype=torch.bfloat16)
        kernel.add_rms_norm(x.clone(), residual, weight, 1e-6)  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            normed, summed = kernel.add_rms_norm(x, residual, weight, 1e-6)
        x.copy_(torch.full_like(x, rank + 1.0))
        graph.replay()
        torch.cuda.synchronize()
        out["graph"] = (float(summed.float().min()), float(summed.float().max()),
                        float(normed.float().min()), float(normed.float().max()))
        results[rank] = out


def test_fused_all_reduce_add_rms_norm_matches_the_steps_and_replays_in_a_graph():
    pytest.importorskip("flashinfer.comm")
    results = mp.Manager().dict()
    mp.start_processes(_rank, args=(free_port(), results), nprocs=2, start_method="spawn")
    for rank in range(2):
        out = results[rank]
        for shape, one_shot in itertools.product(SHAPES[:-1], ONE_SHOT):
            if one_shot is False and shape[0] <= 2:
                assert out[shape, one_shot] is None, f"{shape}: two-shot needs more rows than ranks"
                continue
            assert out[shape, one_shot] is not None, f"{shape} fits the fused kernel (one_shot={one_shot})"
            normed_diff, summed_diff, scale = out[shape, one_shot]
            # One bfloat16 rounding apart at most (the sum may be rounded once more or less on either side).
            assert summed_diff <= 2 ** -7 * 8, f"{shape}, one_shot={one_shot}: the sum differs by {summed_diff}"
            assert normed_diff <= 2 ** -7 * scale * 2, f"{shape}, one_shot={one_shot}: normed differs by {normed_diff}"
        assert all(out[SHAPES[-1], one_shot] is None for one_shot in ONE_SHOT), \
            "a message past the limit is left to the two steps"
        # Replayed: the inputs sum to 1 + 2 = 3, plus the residual 1; the norm of a constant row is 1.
        assert out["graph"] == (4.0, 4.0, 1.0, 1.0)


def test_engine_greedy_with_the_fused_all_reduce(tmp_path, monkeypatch):
    """bfloat16 at TP=2 with the fused kernel: HF's float32 greedy tokens up to a near tie (0.1 nats)."""
    pytest.importorskip("flashinfer.comm")
    from dovetail import LLM, SamplingParams
    from test_models_vs_hf import save_checkpoint
    from tiny_models import assert_greedy_matches, hf_greedy, load_hf, tiny_llama_config

    path = save_checkpoint(tmp_path, tiny_llama_config(hidden_size=512, intermediate_size=512,
                                                       num_attention_heads=4, num_key_value_heads=2))
    prompts = [[5, 6, 7, 8, 9, 10], list(range(20, 61)), [42] * 33]
    hf = load_hf(path)
    references = [hf_greedy(hf, p, 16) for p in prompts]
    monkeypatch.setenv("DOVETAIL_ALL_REDUCE", "flashinfer")
    llm = LLM(str(path), device="cuda", dtype="bfloat16", tensor_parallel_size=2, gpu_memory_utilization=0.3,
              max_model_len=256, max_num_seqs=8)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for output, (hf_tokens, hf_logprobs) in zip(outputs, references):
        assert_greedy_matches(output.outputs[0].token_ids, hf_tokens, hf_logprobs, tol=0.1)
