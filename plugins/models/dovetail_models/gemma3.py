"""Gemma 3 (text): Gemma 2's layers with q/k norms and a rope base per layer type, without attention soft-capping.

Sliding layers use ``rope_parameters["sliding_attention"]`` (the local base
frequency) and global layers ``rope_parameters["full_attention"]``. Like HF's
Gemma 3, attention scores are not soft-capped even when the config sets
``attn_logit_softcapping``; the final logits are, when
``final_logit_softcapping`` is set. Bidirectional (embedding) variants are refused.
"""

from __future__ import annotations

from dovetail.errors import ModelLoadError
from dovetail.layers.rotary import rope_parameters
from dovetail_models.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM, Gemma2Model
from dovetail_models.llama import LlamaAttention


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    """Gemma 2's layer with ``(1 + weight)`` q/k norms and this layer type's rope."""

    @staticmethod
    def attn_logit_softcap(config) -> float | None:
        return None

    def make_attention(self, config, layer_index, ctx, prefix):
        layer_type = config.layer_types[layer_index]
        return LlamaAttention(config, layer_index, ctx, prefix, scale=config.query_pre_attn_scalar**-0.5,
                              sliding_window=self.sliding_window(config, layer_index),
                              rope=rope_parameters(config, layer_type), qk_norm_offset=1.0)


class Gemma3Model(Gemma2Model):
    """Scaled embeddings, Gemma 3 layers, a ``(1 + weight)`` final norm."""

    layer_cls = Gemma3DecoderLayer


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text causal LM (a ``Gemma3TextConfig``)."""

    model_cls = Gemma3Model
    example_models = ("google/gemma-3-1b-it", "google/gemma-3-270m")
    features = ("alternating sliding-window layers (local rope base)", "q/k norm", "query_pre_attn_scalar",
                "(1 + weight) norms", "tied embeddings")

    def __init__(self, hf_config, prefix: str = "", *, ctx):
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ModelLoadError("use_bidirectional_attention: true (config.json) makes an embedding model, "
                                 "not a causal LM; Gemma3ForCausalLM needs causal attention")
        super().__init__(hf_config, prefix, ctx=ctx)
