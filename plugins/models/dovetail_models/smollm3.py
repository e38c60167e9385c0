"""SmolLM3: Llama whose layers marked 0 in ``no_rope_layers`` attend without rotary embeddings (NoPE), with
sliding windows where ``use_sliding_window`` and ``layer_types`` put them."""

from __future__ import annotations

from dovetail_models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


def smollm3_window(config, layer_index: int) -> int | None:
    """``sliding_window`` on the layers ``layer_types`` marks, when ``use_sliding_window`` is on."""
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "use_sliding_window", False) and layer_types[layer_index] == "sliding_attention":
        return getattr(config, "sliding_window", None) or None
    return None


class SmolLM3DecoderLayer(LlamaDecoderLayer):
    """A Llama layer of SmolLM3's attention."""

    sliding_window = staticmethod(smollm3_window)

    def make_attention(self, config, layer_index, ctx, prefix):
        return LlamaAttention(config, layer_index, ctx, prefix, sliding_window=self.sliding_window(config, layer_index),
                              use_rope=bool(config.no_rope_layers[layer_index]))


class SmolLM3Model(LlamaModel):
    """Llama's model with SmolLM3's layers."""

    layer_cls = SmolLM3DecoderLayer


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3 causal LM."""

    model_cls = SmolLM3Model
    example_models = ("HuggingFaceTB/SmolLM3-3B",)
    features = ("NoPE layers (`no_rope_layers`)", "GQA", "sliding window on the layers `layer_types` marks",
                "tied embeddings")
