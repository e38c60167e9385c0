"""``AcmeForCausalLM``: Acme's own architecture name for a Llama-shaped decoder.

It is built only from Dovetail's public layers, to show that a vendor can add an
architecture the core and the model zoo have never heard of.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from dovetail.layers.activation import gated_activation
from dovetail.layers.attention import Attention
from dovetail.layers.embedding import LMHead, VocabEmbedding
from dovetail.layers.linear import Linear
from dovetail.layers.norm import RMSNorm
from dovetail.layers.rotary import RotaryEmbedding, rope_parameters
from dovetail.layers.weights import WeightMapper
from dovetail.model_interface import DovetailModel


class AcmeBlock(nn.Module):
    """One pre-norm decoder block: attention then gated MLP."""

    def __init__(self, config, index, ctx, prefix):
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // heads
        self.sizes = [heads * self.head_dim, kv_heads * self.head_dim, kv_heads * self.head_dim]
        self.qkv_proj = Linear(config.hidden_size, self.sizes, False, ctx, f"{prefix}.self_attn.qkv_proj")
        self.o_proj = Linear(self.sizes[0], config.hidden_size, False, ctx, f"{prefix}.self_attn.o_proj")
        self.rotary = RotaryEmbedding(self.head_dim, config.max_position_embeddings, rope_parameters(config), ctx)
        self.attn = Attention(heads, self.head_dim, self.head_dim ** -0.5, kv_heads, ctx, index)
        self.gate_up_proj = Linear(config.hidden_size, [config.intermediate_size] * 2, False, ctx,
                                   f"{prefix}.mlp.gate_up_proj")
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, ctx, f"{prefix}.mlp.down_proj")
        self.act = gated_activation(config.hidden_act, ctx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)

    def forward(self, positions, hidden, residual):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        q, k, v = self.qkv_proj(hidden).split(self.sizes, dim=-1)
        q, k = self.rotary(positions, q, k)
        hidden, residual = self.post_attention_layernorm(self.o_proj(self.attn(q, k, v)), residual)
        return self.down_proj(self.act(self.gate_up_proj(hidden))), residual


class AcmeForCausalLM(DovetailModel):
    """A Llama-shaped causal LM registered under Acme's own architecture name."""

    def __init__(self, hf_config, prefix: str = "", *, ctx):
        super().__init__(hf_config, prefix, ctx=ctx)
        self.embed_tokens = VocabEmbedding(hf_config.vocab_size, hf_config.hidden_size, ctx)
        self.layers = nn.ModuleList(AcmeBlock(hf_config, i, ctx, f"layers.{i}")
                                    for i in range(hf_config.num_hidden_layers))
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, ctx)
        self.lm_head = LMHead(hf_config.vocab_size, hf_config.hidden_size, ctx,
                              tied_to=self.embed_tokens if hf_config.tie_word_embeddings else None)

    def forward(self, input_ids, positions):
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden_states):
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # The checkpoint uses HF Llama names ("model.layers.0.self_attn.q_proj.weight").
        rename = [(r"^model\.", ""), (r"\.self_attn\.", "."), (r"\.mlp\.", ".")]
        ignore = [r"^lm_head\.weight$"] if self.lm_head.tied else []
        return WeightMapper(self, ignore=ignore, rename=rename).load(weights)
