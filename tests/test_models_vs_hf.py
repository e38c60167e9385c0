"""Every architecture of the model zoo against HF transformers: greedy tokens and logprobs.

Each case is a tiny random model built with transformers' own class, its
special features switched on, every 1-D parameter (norm weights, biases)
perturbed so that a norm offset or a bias left out shows, saved as sharded
safetensors, and run by the engine on the REFERENCE backend in float32.
"""

from __future__ import annotations

import json

import pytest
import torch

from dovetail import LLM, SamplingParams
from tiny_models import (assert_greedy_matches, build_tokenizer, check_matches, completions, first_divergence,
                         hf_greedy, load_hf)

VOCAB = 320
WINDOW = 8
MAX_TOKENS = 10
#: Short, longer than the sliding window, and a batch-mate of a different length.
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 47)), [42, 17] * 9 + [3]]
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, bos_token_id=0,
            eos_token_id=1, pad_token_id=0)


def _config(cls_name: str, **overrides):
    import transformers

    return getattr(transformers, cls_name)(**{**BASE, **overrides})


CASES = {
    "llama-tied-head_dim-bias": lambda: _config("LlamaConfig", tie_word_embeddings=True, head_dim=24,
                                                attention_bias=True, mlp_bias=True),
    "llama-rope-llama3": lambda: _config("LlamaConfig", rope_parameters=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64, rope_theta=10000.0)),
    "llama-rope-linear": lambda: _config("LlamaConfig", rope_parameters=dict(
        rope_type="linear", factor=2.0, rope_theta=10000.0)),
    "llama-rope-dynamic": lambda: _config("LlamaConfig", rope_parameters=dict(
        rope_type="dynamic", factor=2.0, rope_theta=10000.0)),
    "llama-rope-yarn": lambda: _config("LlamaConfig", rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32, rope_theta=10000.0)),
    # An odd vocabulary: two ranks hold 161 rows each, the last one padding.
    "mistral-sliding-odd-vocab": lambda: _config("MistralConfig", sliding_window=WINDOW, vocab_size=VOCAB + 1),
    "qwen2-bias-sliding-layer": lambda: _config("Qwen2Config", use_sliding_window=True, sliding_window=WINDOW,
                                                max_window_layers=1, tie_word_embeddings=True),
    "qwen3-qknorm-head_dim": lambda: _config("Qwen3Config", head_dim=24, attention_bias=True),
    "qwen3moe-normtopk-dense-layer": lambda: _config(
        "Qwen3MoeConfig", num_hidden_layers=3, head_dim=24, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen3moe-sparse-step": lambda: _config(
        "Qwen3MoeConfig", num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=False,
        decoder_sparse_step=2),
    "qwen2moe-shared-expert-dense-layer": lambda: _config(
        "Qwen2MoeConfig", num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1], use_sliding_window=True,
        sliding_window=WINDOW, max_window_layers=1),
    "mixtral-sliding": lambda: _config("MixtralConfig", num_local_experts=4, num_experts_per_tok=2,
                                       sliding_window=WINDOW),
    "gemma2-softcap-sliding": lambda: _config(
        "Gemma2Config", num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    "gemma3-local-rope-qknorm": lambda: _config(
        "Gemma3TextConfig", num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
        sliding_window_pattern=2, final_logit_softcapping=3.0, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}),
    "gemma-geglu-offset-norms": lambda: _config("GemmaConfig", head_dim=24, hidden_activation="gelu_pytorch_tanh"),
    "granite-multipliers": lambda: _config("GraniteConfig", embedding_multiplier=3.0, attention_multiplier=0.3,
                                           residual_multiplier=0.5, logits_scaling=4.0, tie_word_embeddings=True),
    "smollm3-nope-sliding": lambda: _config("SmolLM3Config", num_hidden_layers=3, no_rope_layers=[1, 0, 1],
                                            use_sliding_window=True, sliding_window=WINDOW,
                                            layer_types=["sliding_attention", "full_attention",
                                                         "sliding_attention"]),
    "olmo2-post-norms-projection-qknorm": lambda: _config("Olmo2Config"),
    # One KV head for two ranks: the key norm's squares are held twice.
    "olmo3-sliding-rope-per-type-one-kv-head": lambda: _config(
        "Olmo3Config", num_hidden_layers=3, num_key_value_heads=1, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}}),
    "seed-oss-qkv-bias-head_dim": lambda: _config("SeedOssConfig", head_dim=24, attention_bias=True,
                                                  attention_out_bias=False),
    "starcoder2-layernorm-bias-sliding": lambda: _config("Starcoder2Config", sliding_window=WINDOW, use_bias=True,
                                                         hidden_act="gelu_pytorch_tanh"),
    # Windowed layers with rope, the global one without.
    "exaone4-post-norms-qknorm-nope-global": lambda: _config(
        "Exaone4Config", num_hidden_layers=3, head_dim=24, sliding_window=WINDOW, sliding_window_pattern=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "arcee-relu2-no-gate": lambda: _config("ArceeConfig", hidden_act="relu2", mlp_bias=True),
    "phi3-fused-sliding-partial-rotary": lambda: _config(
        "Phi3Config", sliding_window=WINDOW, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                  partial_rotary_factor=0.5)),
}


def save_checkpoint(path, config, seed: int = 0):
    """The HF model of ``config`` with perturbed 1-D parameters, saved as sharded safetensors."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(str(path), max_shard_size="20KB")
    build_tokenizer(path, vocab_size=300)
    assert len(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    return path


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    path = save_checkpoint(tmp_path_factory.mktemp(request.param), CASES[request.param]())
    hf = load_hf(path)
    reference = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    return request.param, path, reference


def run_engine(path, prompts=PROMPTS, **kwargs):
    llm = LLM(str(path), attention_backend="REFERENCE", max_model_len=256, num_gpu_blocks_override=64,
              block_size=4, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def check_matches_hf(completed, reference, tol: float = 1e-4):
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(completed, reference):
        assert_greedy_matches(tokens, hf_tokens, hf_logprobs)
        same_until = first_divergence(tokens, hf_tokens)
        for step in range(len(hf_tokens) if same_until is None else same_until):
            entry, hf_step = logprobs[step], hf_logprobs[step]
            token = tokens[step]
            assert abs(entry[token] - float(hf_step[token])) < tol, f"step {step}"
            top = hf_step.topk(3)
            for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
                assert tid in entry and abs(entry[tid] - lp) < tol, f"step {step}, token {tid}"


@pytest.fixture(scope="module")
def one_rank(case):
    """The engine's completions of the case on one rank."""
    _, path, _ = case
    return completions(run_engine(path)[1])


def test_engine_matches_hf(case, one_rank):
    name, path, reference = case
    assert len(list(path.glob("*.safetensors"))) > 1, "the checkpoint must be sharded"
    check_matches_hf(one_rank, reference)


@pytest.mark.gpu
def test_engine_on_a_gpu_matches_the_engine_on_the_cpu(case):
    """Every architecture on an NVIDIA GPU in float32 (``dtype="auto"`` would run these float32 checkpoints in
    bfloat16 there), the REFERENCE backend, against the engine on the CPU (which the test above holds to HF:
    compared here rather than HF on the same machine, whose transformers release may differ, e.g. in whether
    Gemma 2's attention soft-capping applies)."""
    _, path, _ = case
    on_cpu = completions(run_engine(path, device="cpu", dtype="float32")[1])
    check_matches(completions(run_engine(path, device="cuda", dtype="float32")[1]), on_cpu, tol=1e-3)


def tp_generate(path: str) -> list:
    """On each rank of a tensor-parallel group: the engine's completions (run by tests/spmd.py)."""
    return completions(run_engine(path, cpu_threads=1)[1])


def test_engine_matches_hf_at_tensor_parallel_2(case, one_rank, tp_ranks):
    """Every architecture with its weights split over two ranks (real processes over gloo, reused across
    cases; tests/test_tp_engine.py runs some through the engine's ``mp`` executor): the same greedy tokens
    and log-probabilities as HF and as one rank, and the same on both ranks."""
    name, path, reference = case
    ranks = tp_ranks(2).run(tp_generate, str(path))
    assert ranks[0] == ranks[1], "the ranks sampled different tokens or log-probabilities"
    check_matches_hf(ranks[0], reference)
    check_matches(ranks[0], one_rank)
