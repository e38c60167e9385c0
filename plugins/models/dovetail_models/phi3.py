"""Phi-3: Llama with fused ``qkv_proj`` and ``gate_up_proj`` checkpoint tensors and a sliding window.

The fused checkpoint tensors load whole into the merged projections; rope
``longrope`` (the 128k-context variants) is not supported and is refused.
"""

from __future__ import annotations

from dovetail_models.llama import LlamaForCausalLM, LlamaModel
from dovetail_models.mistral import MistralDecoderLayer


class Phi3Model(LlamaModel):
    """Llama's model with a sliding window on every layer (when the config sets one)."""

    layer_cls = MistralDecoderLayer


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 causal LM (and Phi-4, which shares the architecture)."""

    model_cls = Phi3Model
    example_models = ("microsoft/Phi-3-mini-4k-instruct", "microsoft/Phi-3-medium-4k-instruct", "microsoft/phi-4")
    features = ("fused qkv/gate_up checkpoints", "sliding window", "partial rotary")
