"""Gemma 2: soft-capped attention and logits, alternating sliding-window layers, sandwich norms.

Everything HF's Gemma 2 does differently from Llama: attention scores scaled by
``query_pre_attn_scalar ** -0.5`` and soft-capped (``attn_logit_softcapping``),
final logits soft-capped (``final_logit_softcapping``), windowed layers from
``layer_types``, embeddings scaled by ``sqrt(hidden_size)`` rounded to the
model's dtype, ``(1 + weight)`` RMSNorms, norms after attention and around the
MLP, and ``gelu_pytorch_tanh`` (``hidden_activation``).
"""

from __future__ import annotations

from torch import nn

from dovetail.layers.norm import RMSNorm
from dovetail.model_interface import ModelContext, run_to_end
from dovetail_models.gemma import GemmaModel, gemma_activation
from dovetail_models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, window_from_layer_types


class Gemma2DecoderLayer(nn.Module):
    """Attention and MLP, each between a pre-norm and a post-norm; the residual add is fused."""

    sliding_window = staticmethod(window_from_layer_types)

    def __init__(self, config, layer_index: int, ctx: ModelContext, prefix: str):
        super().__init__()
        self.self_attn = self.make_attention(config, layer_index, ctx, f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config, ctx, f"{prefix}.mlp", hidden_act=gemma_activation(config))
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, ctx, weight_offset=1.0)
        self.post_attention_layernorm = RMSNorm(size, eps, ctx, weight_offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, ctx, weight_offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(size, eps, ctx, weight_offset=1.0)

    @staticmethod
    def attn_logit_softcap(config) -> float | None:
        return getattr(config, "attn_logit_softcapping", None) or None

    def make_attention(self, config, layer_index, ctx, prefix):
        return LlamaAttention(config, layer_index, ctx, prefix, scale=config.query_pre_attn_scalar**-0.5,
                              sliding_window=self.sliding_window(config, layer_index),
                              logit_softcap=self.attn_logit_softcap(config))

    def forward(self, positions, hidden_states, residual):
        return run_to_end(self.forward_steps(positions, hidden_states, residual))

    def forward_steps(self, positions, hidden_states, residual):
        """:meth:`forward`, pausing after each block (whose row-parallel output layer all-reduces)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(positions, hidden_states))
        yield
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        yield
        return hidden_states, residual


class Gemma2Model(GemmaModel):
    """Gemma's scaled embeddings and ``(1 + weight)`` final norm, Gemma 2 layers."""

    layer_cls = Gemma2DecoderLayer


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 causal LM (embeddings tied to the LM head by default)."""

    model_cls = Gemma2Model
    example_models = ("google/gemma-2-2b-it", "google/gemma-2-9b-it", "google/gemma-2-27b-it")
    features = ("attention and final logit soft-capping", "alternating sliding-window layers",
                "query_pre_attn_scalar", "(1 + weight) norms", "tied embeddings")

    @classmethod
    def final_logit_softcap(cls, config) -> float | None:
        return getattr(config, "final_logit_softcapping", None) or None
