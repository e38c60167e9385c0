"""Tensor parallelism on two NVIDIA GPUs over NCCL: each rank's engine captures its decode graphs with the
all-reduces and the LM head's all-gather inside; greedy float32 tokens against one GPU and HF (GPU)."""

from __future__ import annotations

import gc

import pytest
import torch

from dovetail import LLM, SamplingParams
from tiny_models import check_matches, completions, load_hf, save_model, tiny_llama_config

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 61)), [3], [42] * 33]
MAX_TOKENS = 16
#: float32 on TRITON (graph-capturable); a fixed KV cache so that every rank schedules alike.
ENGINE = dict(device="cuda", dtype="float32", attention_backend="TRITON", max_model_len=256,
              num_gpu_blocks_override=128, max_num_seqs=8)
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two NVIDIA GPUs")
    from spmd import SpmdRanks

    ranks = SpmdRanks(2, backend="nccl")
    yield ranks
    ranks.close()


def gpu_generate(path: str) -> tuple[bool, list]:
    """On each rank: whether decode graphs were captured, and the greedy completions."""
    llm = LLM(path, **ENGINE)
    engine = llm.llm_engine
    runner = engine.runner if hasattr(engine, "runner") else engine.executor.worker.runner
    result = runner.graphs is not None, completions(llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                                  PARAMS, use_tqdm=False))
    del llm, engine, runner
    gc.collect()
    torch.cuda.empty_cache()
    return result


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
def test_tensor_parallel_2_on_two_gpus_matches_one_gpu_and_hf(two_gpus, tmp_path, arch):
    if arch == "llama":  # head size 128, two KV heads: one per rank
        config = tiny_llama_config(hidden_size=512, intermediate_size=512, num_attention_heads=4,
                                   num_key_value_heads=2)
    else:
        from transformers import Qwen3MoeConfig

        config = Qwen3MoeConfig(vocab_size=320, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                max_position_embeddings=512, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=128, norm_topk_prob=True, initializer_range=0.1,
                                bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    path = save_model(tmp_path / arch, config)
    hf = load_hf(path).cuda()
    reference = [_hf_greedy_cuda(hf, p) for p in PROMPTS]
    del hf
    one_gpu = completions(LLM(str(path), **ENGINE).generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS,
                                                            use_tqdm=False))
    gc.collect()
    torch.cuda.empty_cache()
    (graphs_0, rank_0), (graphs_1, rank_1) = two_gpus.run(gpu_generate, str(path))
    assert graphs_0 and graphs_1, "decode graphs are captured under tensor parallelism"
    assert rank_0 == rank_1, "the ranks sampled different tokens or log-probabilities"
    check_matches(rank_0, one_gpu, tol=1e-4)
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(rank_0, reference):
        expected = [(hf_tokens, [{int(t): float(lp[t]) for t in lp.topk(2).indices} for lp in hf_logprobs])]
        check_matches([(tokens, logprobs)], expected, tol=1e-4)


@torch.no_grad()
def _hf_greedy_cuda(model, prompt):
    out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                         do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [torch.log_softmax(s[0].float(), -1).cpu() for s in out.logits]
