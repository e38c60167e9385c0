"""Rotary position embeddings with HF's scalings: default, linear, dynamic, llama3, yarn.

The cosines and sines of every position up to ``max_position`` are computed
once, in float32, into ``cos_sin_cache`` (cosines first, then sines); the
rotation itself is the platform's fused op.

``dynamic`` (NTK) is made stateless: a token at position ``p`` uses the
frequencies HF uses for a sequence of ``max(p + 1, max_position_embeddings)``
tokens, which equals HF for sequences within ``max_position_embeddings``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dovetail.model_interface import ModelContext


def rope_parameters(hf_config, layer_type: str | None = None) -> dict:
    """The rope parameters (``rope_theta``, ``rope_type`` and scaling fields) of a config.

    Reads transformers 5's ``rope_parameters`` (per layer type for Gemma 3) and
    transformers 4's ``rope_theta`` plus ``rope_scaling``.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    params = dict(params)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(base: float, dim: int, p: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    factor = p.get("factor")
    original = p.get("original_max_position_embeddings") or max_position_embeddings
    if factor is None:
        factor = max_position_embeddings / original

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def compute_cos_sin_cache(rotary_dim: int, max_position: int, params: dict,
                          max_position_embeddings: int) -> torch.Tensor:
    """``[max_position, rotary_dim]`` float32: cosines then sines, per position."""
    base = params["rope_theta"]
    rope_type = params["rope_type"]
    positions = torch.arange(max_position, dtype=torch.float32)
    scaling = 1.0
    if rope_type == "default":
        inv_freq = _base_inv_freq(base, rotary_dim)
    elif rope_type == "linear":
        inv_freq = _base_inv_freq(base, rotary_dim) / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(_base_inv_freq(base, rotary_dim), params)
    elif rope_type == "yarn":
        inv_freq, scaling = _yarn_inv_freq(base, rotary_dim, params, max_position_embeddings)
    elif rope_type == "dynamic":
        factor = params["factor"]
        seq_len = torch.clamp(positions + 1, min=max_position_embeddings)
        bases = base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        freqs = positions.unsqueeze(1) * (1.0 / bases.unsqueeze(1) ** exponents.unsqueeze(0))
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    else:
        raise ValueError(f"rope_parameters.rope_type {rope_type!r} (config.json) is not supported "
                         "(supported: default, linear, dynamic, llama3, yarn)")
    freqs = torch.outer(positions, inv_freq)
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)


_CACHES: dict[tuple, torch.Tensor] = {}


def _shared_cache(rotary_dim: int, max_position: int, params: dict, max_position_embeddings: int,
                  device: torch.device) -> torch.Tensor:
    """One cos/sin table per distinct rope, shared by every layer that uses it (tables can be large:
    Llama 3.1 has 131072 positions)."""
    key = (rotary_dim, max_position, repr(sorted(params.items())), max_position_embeddings, str(device))
    cache = _CACHES.get(key)
    if cache is None:
        cache = compute_cos_sin_cache(rotary_dim, max_position, params, max_position_embeddings).to(device)
        _CACHES[key] = cache
    return cache


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to flattened ``q`` and ``k`` at ``positions`` (NeoX style)."""

    def __init__(self, head_size: int, max_position: int, params: dict, ctx: ModelContext,
                 max_position_embeddings: int | None = None, partial_rotary_factor: float | None = None):
        super().__init__()
        self.head_size = head_size
        factor = partial_rotary_factor if partial_rotary_factor is not None else params.get("partial_rotary_factor", 1.0)
        self.rotary_dim = int(head_size * factor)
        self.ops = ctx.ops
        cache = _shared_cache(self.rotary_dim, max_position, params, max_position_embeddings or max_position,
                              ctx.device)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return self.ops.rotary_embedding(positions, q, k, self.cos_sin_cache, self.head_size, self.rotary_dim)

    def forward_with_qk_norm(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm, k_norm):
        """Per-head RMSNorm of ``q`` and ``k`` (the :class:`~dovetail.layers.norm.RMSNorm` layers given), then
        the rotation: one fused op, which a platform may run as one kernel."""
        return self.ops.qk_norm_rotary_embedding(positions, q, k, q_norm.weight, k_norm.weight, q_norm.eps,
                                                 self.cos_sin_cache, self.head_size, self.rotary_dim)
