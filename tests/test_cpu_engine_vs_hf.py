"""Whole models through the CPU platform's kernels (CPU_SIMD attention, C++ fused ops) against HF transformers.

Greedy tokens and logprobs in float32: a GQA Llama (mixed prefill/decode batches, chunked prefill,
prefix caching, preemption), Gemma 2 (logit soft-capping, sliding window) and Phi-3 (partial rotary).
"""

from __future__ import annotations

import pytest
import torch

from dovetail import LLM, SamplingParams
from dovetail_cpu import isa
from dovetail_cpu.ops import CpuFusedOps
from tiny_models import assert_greedy_matches, build_tokenizer, first_divergence, hf_greedy, load_hf

PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 61)), [3], list(range(100, 117)), [42] * 33]
MAX_TOKENS = 16


def generate(llm, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def check(outputs, reference, tol=1e-4):
    for out, (tokens, hf_logprobs) in zip(outputs, reference):
        completion = out.outputs[0]
        assert_greedy_matches(completion.token_ids, tokens, hf_logprobs)
        same = first_divergence(completion.token_ids, tokens)
        for step in range(len(tokens) if same is None else same):
            token = completion.token_ids[step]
            assert abs(completion.logprobs[step][token].logprob - float(hf_logprobs[step][token])) < tol


@pytest.fixture(scope="module")
def llama_reference(tiny_llama_hf):
    return [hf_greedy(tiny_llama_hf, p, MAX_TOKENS) for p in PROMPTS]


def test_cpu_simd_is_chosen_by_default_and_matches_hf(tiny_llama_dir, llama_reference):
    llm = LLM(str(tiny_llama_dir))
    engine = llm.llm_engine
    assert engine.attention_backend.name == "CPU_SIMD"
    assert isinstance(engine.model.model.layers[0].input_layernorm.ops, CpuFusedOps)
    check(generate(llm), llama_reference)


@pytest.mark.parametrize("path", ["portable", "avx2"])
def test_forced_isa_path_matches_hf(tiny_llama_dir, llama_reference, path):
    if path not in isa.supported_isas():
        pytest.skip(f"this CPU lacks the {path} path")
    before = isa.selected_isa()
    isa.select_isa(path)
    try:
        check(generate(LLM(str(tiny_llama_dir), attention_backend="CPU_SIMD")), llama_reference)
    finally:
        isa.select_isa(before)


def test_chunked_prefill_prefix_cache_and_preemption(tiny_llama_dir, llama_reference):
    llm = LLM(str(tiny_llama_dir), attention_backend="CPU_SIMD", max_num_batched_tokens=7, max_num_seqs=3,
              block_size=8)
    check(generate(llm), llama_reference)
    again = generate(llm)
    assert any(o.num_cached_tokens > 0 for o in again)
    check(again, llama_reference)
    small = LLM(str(tiny_llama_dir), attention_backend="CPU_SIMD", num_gpu_blocks_override=31, max_num_seqs=8,
                max_model_len=200)
    prompts = [list(range(10 + i, 160 + i)) for i in range(4)]
    outputs = generate(small, prompts, max_tokens=12)
    assert small.llm_engine.scheduler.num_preemptions > 0
    hf = load_hf(tiny_llama_dir)
    check(outputs, [hf_greedy(hf, p, 12) for p in prompts])


def _checkpoint(tmp_path, config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(str(tmp_path))
    build_tokenizer(tmp_path, vocab_size=300)
    return tmp_path


BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, bos_token_id=0,
            eos_token_id=1, pad_token_id=0)


@pytest.mark.parametrize("name", ["gemma2-softcap-window", "phi3-partial-rotary-window"])
def test_softcap_window_and_partial_rotary_models(tmp_path, name):
    import transformers

    if name.startswith("gemma2"):
        config = transformers.Gemma2Config(**{**BASE, "num_hidden_layers": 3, "head_dim": 32,
                                              "query_pre_attn_scalar": 24, "sliding_window": 8,
                                              "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0})
    else:
        config = transformers.Phi3Config(**{**BASE, "hidden_size": 128, "sliding_window": 8, "rope_parameters": dict(
            rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)})
    path = _checkpoint(tmp_path, config)
    hf = load_hf(path)
    prompts = [[5, 6, 7, 8, 9, 10], list(range(20, 47)), [42, 17] * 9 + [3]]
    reference = [hf_greedy(hf, p, 10) for p in prompts]
    llm = LLM(str(path), attention_backend="CPU_SIMD", max_model_len=256, block_size=8)
    check(generate(llm, prompts, max_tokens=10), reference)
