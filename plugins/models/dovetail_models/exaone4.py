"""EXAONE 4.0 (LG AI Research): OLMo 2's norms after the blocks, Qwen 3's RMSNorm on each query and key head,
and, where the config sets a sliding window, windowed layers (from ``layer_types``) with rotary embeddings
between global layers without them."""

from __future__ import annotations

from dovetail_models.llama import LlamaAttention, window_from_layer_types
from dovetail_models.olmo2 import Olmo2DecoderLayer, Olmo2ForCausalLM, Olmo2Model


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    """OLMo 2's layer with per-head q/k norms, and rope only on windowed layers when there are some."""

    sliding_window = staticmethod(window_from_layer_types)

    def make_attention(self, config, layer_index, ctx, prefix):
        window = self.sliding_window(config, layer_index)
        return LlamaAttention(config, layer_index, ctx, prefix, sliding_window=window, qk_norm_offset=0.0,
                              use_rope=getattr(config, "sliding_window", None) is None or window is not None)


class Exaone4Model(Olmo2Model):
    """Llama's model with EXAONE 4.0's layers."""

    layer_cls = Exaone4DecoderLayer


class Exaone4ForCausalLM(Olmo2ForCausalLM):
    """EXAONE 4.0 causal LM."""

    model_cls = Exaone4Model
    example_models = ("LGAI-EXAONE/EXAONE-4.0-1.2B", "LGAI-EXAONE/EXAONE-4.0-32B")
    features = ("norms after attention and MLP", "q/k norm", "sliding-window layers, global ones without rope",
                "GQA", "tied embeddings (1.2B)")
