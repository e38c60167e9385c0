"""Rotary embeddings against HF's: every scaling, partial rotary, per-layer-type rope, and the config readers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dovetail.layers.rotary import compute_cos_sin_cache, rope_parameters

HEAD_DIM = 32
MAX_POS = 64

SCALINGS = {
    "default": dict(rope_type="default"),
    "linear": dict(rope_type="linear", factor=4.0),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    "yarn-mscale": dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=16, mscale=0.707,
                        mscale_all_dim=0.707, beta_fast=16, beta_slow=2),
    "dynamic": dict(rope_type="dynamic", factor=2.0),
}


def _llama_config(params: dict, partial: float = 1.0):
    from transformers import LlamaConfig

    rope = {**params, "rope_theta": 500.0}
    if partial != 1.0:
        rope["partial_rotary_factor"] = partial
    return LlamaConfig(hidden_size=HEAD_DIM * 2, num_attention_heads=2, max_position_embeddings=MAX_POS,
                       rope_parameters=rope)


def _hf_cos_sin(rotary, positions: torch.Tensor, **kwargs):
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions.view(1, -1), **kwargs)
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


def _ours(config, rotary_dim: int, max_position: int, layer_type=None):
    cache = compute_cos_sin_cache(rotary_dim, max_position, rope_parameters(config, layer_type),
                                  config.max_position_embeddings)
    return cache.chunk(2, dim=-1)


# HF's default rope for Llama ignores partial_rotary_factor (Phi-3's honours it: see test_models_vs_hf).
@pytest.mark.parametrize("name,partial", [(n, 1.0) for n in sorted(SCALINGS)]
                         + [(n, 0.5) for n in sorted(SCALINGS) if n != "default"])
def test_cos_sin_match_hf_within_max_position(name, partial):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _llama_config(SCALINGS[name], partial)
    positions = torch.arange(MAX_POS)
    hf_cos, hf_sin = _hf_cos_sin(LlamaRotaryEmbedding(config), positions)
    cos, sin = _ours(config, int(HEAD_DIM * partial), MAX_POS)
    torch.testing.assert_close(cos, hf_cos, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(sin, hf_sin, rtol=1e-5, atol=2e-6)


def test_dynamic_beyond_max_position_uses_the_frequencies_of_the_sequence_so_far():
    """HF recomputes dynamic-NTK frequencies for a sequence of ``p + 1`` tokens when it decodes position ``p``."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _llama_config(SCALINGS["dynamic"])
    cos, sin = _ours(config, HEAD_DIM, 3 * MAX_POS)
    default_cos, _ = _ours(_llama_config(SCALINGS["default"]), HEAD_DIM, 3 * MAX_POS)
    for length in (MAX_POS + 1, 2 * MAX_POS, 3 * MAX_POS):
        hf_cos, hf_sin = _hf_cos_sin(LlamaRotaryEmbedding(config), torch.arange(length))
        torch.testing.assert_close(cos[length - 1], hf_cos[-1], rtol=1e-5, atol=2e-6)
        torch.testing.assert_close(sin[length - 1], hf_sin[-1], rtol=1e-5, atol=2e-6)
        assert not torch.allclose(cos[length - 1], default_cos[length - 1]), "beyond max_position it must scale"


def test_gemma3_rope_per_layer_type_matches_hf():
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    config = Gemma3TextConfig(hidden_size=64, num_attention_heads=2, head_dim=HEAD_DIM, num_hidden_layers=2,
                              sliding_window_pattern=2, max_position_embeddings=MAX_POS, rope_parameters={
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                  "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    rotary = Gemma3RotaryEmbedding(config)
    results = {}
    for layer_type in ("sliding_attention", "full_attention"):
        hf_cos, _ = _hf_cos_sin(rotary, torch.arange(MAX_POS), layer_type=layer_type)
        cos, _ = _ours(config, HEAD_DIM, MAX_POS, layer_type)
        torch.testing.assert_close(cos, hf_cos, rtol=1e-5, atol=2e-6)
        results[layer_type] = cos
    assert not torch.allclose(results["sliding_attention"], results["full_attention"])


def test_rope_parameters_reads_transformers_4_fields():
    config = SimpleNamespace(rope_theta=1234.0, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_parameters(config) == {"rope_theta": 1234.0, "type": "linear", "factor": 2.0, "rope_type": "linear"}
    assert rope_parameters(SimpleNamespace(rope_theta=99.0)) == {"rope_theta": 99.0, "rope_type": "default"}


def test_unsupported_rope_type_names_the_field_and_the_supported_types():
    with pytest.raises(ValueError, match=r"rope_parameters.rope_type 'longrope'.*supported: default, linear"):
        compute_cos_sin_cache(16, 8, {"rope_type": "longrope", "rope_theta": 1e4}, 8)
