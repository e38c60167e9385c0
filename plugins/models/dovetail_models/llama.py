"""Llama (2, 3, 3.1, 3.2): the decoder most other architectures here extend."""

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
from dovetail.model_interface import DovetailModel, ModelContext


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """Merged QKV projection, rotary embedding, paged attention, output projection."""

    def __init__(self, config, layer_index: int, ctx: ModelContext, prefix: str,
                 sliding_window: int | None = None, qkv_bias: bool | None = None):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False) if qkv_bias is None else qkv_bias
        self.qkv_proj = Linear(config.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias, ctx,
                               f"{prefix}.qkv_proj")
        self.o_proj = Linear(self.q_size, config.hidden_size, getattr(config, "attention_bias", False), ctx,
                             f"{prefix}.o_proj")
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings, rope_parameters(config),
                                          ctx, config.max_position_embeddings)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, ctx,
                              layer_index, sliding_window=sliding_window)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    """Merged gate/up projection, gated activation, down projection."""

    def __init__(self, config, ctx: ModelContext, prefix: str, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = Linear(config.hidden_size, [inter, inter], bias, ctx, f"{prefix}.gate_up_proj")
        self.down_proj = Linear(inter, config.hidden_size, bias, ctx, f"{prefix}.down_proj")
        self.act_fn = gated_activation(config.hidden_act, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; the residual add is fused into the norms."""

    def __init__(self, config, layer_index: int, ctx: ModelContext, prefix: str):
        super().__init__()
        self.self_attn = self.make_attention(config, layer_index, ctx, f"{prefix}.self_attn")
        self.mlp = self.make_mlp(config, layer_index, ctx, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)

    def make_attention(self, config, layer_index, ctx, prefix):
        return LlamaAttention(config, layer_index, ctx, prefix)

    def make_mlp(self, config, layer_index, ctx, prefix):
        return LlamaMLP(config, ctx, prefix)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm."""

    layer_cls = LlamaDecoderLayer

    def __init__(self, config, ctx: ModelContext, prefix: str = "model"):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, ctx)
        self.layers = nn.ModuleList(self.layer_cls(config, i, ctx, f"{prefix}.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(DovetailModel):
    """Llama causal LM; subclasses swap ``model_cls`` or the layer pieces."""

    model_cls = LlamaModel
    #: Extra checkpoint-name regexes to skip when loading.
    ignore_weights: tuple[str, ...] = ()

    def __init__(self, hf_config, prefix: str = "", *, ctx: ModelContext):
        super().__init__(hf_config, prefix, ctx=ctx)
        self.model = self.model_cls(hf_config, ctx, f"{prefix}model")
        tied = self.model.embed_tokens if getattr(hf_config, "tie_word_embeddings", False) else None
        self.lm_head = LMHead(hf_config.vocab_size, hf_config.hidden_size, ctx, tied_to=tied,
                              final_logit_softcap=getattr(hf_config, "final_logit_softcapping", None))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        ignore = list(self.ignore_weights)
        if self.lm_head.tied:
            ignore.append(r"^lm_head\.weight$")
        return WeightMapper(self, ignore=ignore).load(weights)
