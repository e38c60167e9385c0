"""EXAONE 4.0 (LG AI Research): OLMo 2's norms after the blocks, Qwen 3's RMSNorm on each query and key head,
and, where the config sets a sliding window, windowed layers (from ``layer_types``) with rotary embeddings
between global layers without them."""

from __future__ import annotations

import torch

from dovetail_models.llama import LlamaAttention, window_from_layer_types
from dovetail_models.olmo2 import Olmo2DecoderLayer, Olmo2ForCausalLM, Olmo2Model


class Exaone4Attention(LlamaAttention):
    """Per-head q/k norms; no rotary embedding on the global layers of a model with windowed ones."""

    def __init__(self, config, layer_index, ctx, prefix, sliding_window):
        super().__init__(config, layer_index, ctx, prefix, sliding_window=sliding_window, qk_norm_offset=0.0)
        self.use_rope = getattr(config, "sliding_window", None) is None or sliding_window is not None

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.use_rope:
            return super().forward(positions, hidden_states)
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        return self.o_proj(self.attn(q, k, v))


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    """OLMo 2's layer with EXAONE 4.0's attention."""

    sliding_window = staticmethod(window_from_layer_types)

    def make_attention(self, config, layer_index, ctx, prefix):
        return Exaone4Attention(config, layer_index, ctx, prefix, self.sliding_window(config, layer_index))


class Exaone4Model(Olmo2Model):
    """Llama's model with EXAONE 4.0's layers."""

    layer_cls = Exaone4DecoderLayer


class Exaone4ForCausalLM(Olmo2ForCausalLM):
    """EXAONE 4.0 causal LM."""

    model_cls = Exaone4Model
    example_models = ("LGAI-EXAONE/EXAONE-4.0-1.2B", "LGAI-EXAONE/EXAONE-4.0-32B")
    features = ("norms after attention and MLP", "q/k norm", "sliding-window layers, global ones without rope",
                "GQA", "tied embeddings (1.2B)")
