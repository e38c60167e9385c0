"""Qwen 3: Llama with RMSNorm on each query and key head, and an explicit ``head_dim``."""

from __future__ import annotations

from dovetail_models.llama import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel,
                                   window_from_layer_types)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """q/k RMSNorm over ``head_dim`` before the rotary embedding; windows from ``layer_types``."""

    sliding_window = staticmethod(window_from_layer_types)

    def make_attention(self, config, layer_index, ctx, prefix):
        return LlamaAttention(config, layer_index, ctx, prefix, qk_norm_offset=0.0,
                              sliding_window=self.sliding_window(config, layer_index))


class Qwen3Model(LlamaModel):
    """Llama's model with Qwen 3's layers."""

    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen 3 (dense) causal LM."""

    model_cls = Qwen3Model
    example_models = ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-8B", "Qwen/Qwen3-32B")
    features = ("GQA", "q/k norm", "explicit head_dim", "tied embeddings (small sizes)")
