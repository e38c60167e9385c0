"""Qwen 2 and 2.5: Llama with a bias on the QKV projection, and windowed layers from ``layer_types``."""

from __future__ import annotations

from dovetail_models.llama import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel,
                                   window_from_layer_types)


class Qwen2DecoderLayer(LlamaDecoderLayer):
    """QKV bias (the output projection has none); sliding window where ``layer_types`` says so."""

    sliding_window = staticmethod(window_from_layer_types)

    def make_attention(self, config, layer_index, ctx, prefix):
        return LlamaAttention(config, layer_index, ctx, prefix, qkv_bias=True,
                              sliding_window=self.sliding_window(config, layer_index))


class Qwen2Model(LlamaModel):
    """Llama's model with Qwen 2's layers."""

    layer_cls = Qwen2DecoderLayer


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen 2 causal LM."""

    model_cls = Qwen2Model
    example_models = ("Qwen/Qwen2-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-7B-Instruct")
    features = ("GQA", "QKV bias", "sliding window on the layers `layer_types` marks", "tied embeddings")
