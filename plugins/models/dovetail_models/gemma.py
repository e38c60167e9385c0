"""Gemma (the first): Llama with ``(1 + weight)`` RMSNorms, embeddings scaled by ``sqrt(hidden_size)``, and a
GeGLU MLP (``gelu_pytorch_tanh``); no soft-capping and no sliding window (those came with Gemma 2)."""

from __future__ import annotations

from dovetail.layers.norm import RMSNorm
from dovetail_models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel


def gemma_activation(config) -> str:
    """Gemma's MLP activation: ``hidden_activation`` (older configs: ``hidden_act``)."""
    return getattr(config, "hidden_activation", None) or config.hidden_act


class GemmaDecoderLayer(LlamaDecoderLayer):
    """A Llama layer with ``(1 + weight)`` norms and Gemma's activation."""

    def __init__(self, config, layer_index, ctx, prefix):
        super().__init__(config, layer_index, ctx, prefix)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx, weight_offset=1.0)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx, weight_offset=1.0)

    def make_mlp(self, config, layer_index, ctx, prefix):
        return LlamaMLP(config, ctx, prefix, hidden_act=gemma_activation(config))


class GemmaModel(LlamaModel):
    """Scaled embeddings, Gemma layers, a ``(1 + weight)`` final norm."""

    layer_cls = GemmaDecoderLayer
    norm_offset = 1.0

    @classmethod
    def embedding_scale(cls, config) -> float:
        return config.hidden_size**0.5


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma causal LM (embeddings tied to the LM head by default)."""

    model_cls = GemmaModel
    example_models = ("google/gemma-2b-it", "google/gemma-7b-it", "google/codegemma-7b-it")
    features = ("(1 + weight) norms", "scaled embeddings", "GeGLU (tanh)", "explicit head_dim", "tied embeddings")
