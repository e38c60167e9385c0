"""Mistral: Llama with a sliding attention window on every layer."""

from __future__ import annotations

from dovetail_models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, window_on_every_layer


class MistralDecoderLayer(LlamaDecoderLayer):
    """A Llama layer whose attention sees the last ``sliding_window`` tokens (when the config sets one)."""

    sliding_window = staticmethod(window_on_every_layer)


class MistralModel(LlamaModel):
    """Llama's model with Mistral's layers."""

    layer_cls = MistralDecoderLayer


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral causal LM."""

    model_cls = MistralModel
    example_models = ("mistralai/Mistral-7B-v0.1", "mistralai/Mistral-7B-Instruct-v0.3")
    features = ("GQA", "sliding window")
