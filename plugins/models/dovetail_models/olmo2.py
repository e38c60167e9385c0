"""OLMo 2 and OLMo 3: norms after each block instead of before it, and RMSNorms over the whole query and key
projections (every head at once). OLMo 3 adds sliding-window layers with a rope per layer type.

Under tensor parallelism each rank holds some of the heads, so the query and key norms sum their squares over
the ranks (a key head held by several ranks counted once).
"""

from __future__ import annotations

import torch
from torch import nn

from dovetail.checkpoint_tensor import read
from dovetail.distributed import all_reduce, tp_size
from dovetail.distributed.partition import Part
from dovetail.layers.norm import RMSNorm
from dovetail.layers.rotary import rope_parameters
from dovetail.model_interface import ModelContext
from dovetail_models.llama import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel,
                                   window_from_layer_types)


class ProjectionNorm(nn.Module):
    """RMSNorm over a projection of ``total_size`` columns of which this rank holds ``part`` (its heads), each
    held by ``replicas`` ranks."""

    def __init__(self, total_size: int, part: Part, replicas: int, eps: float, ctx: ModelContext):
        super().__init__()
        self.total_size, self.part, self.replicas, self.eps = total_size, part, replicas, eps
        _, size = part.of(total_size, "q/k norm")
        self.weight = nn.Parameter(torch.ones(size, dtype=ctx.dtype), requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, tensor, shard) -> None:
        start, size = self.part.of(self.total_size, "q/k norm")
        param.data.copy_(read(tensor)[start:start + size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squares = x.float().pow(2).sum(-1, keepdim=True)
        if tp_size() > 1:
            squares = all_reduce(squares) / self.replicas
        normed = x.float() * torch.rsqrt(squares / self.total_size + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class Olmo2Attention(LlamaAttention):
    """Llama's attention with the query and key projections normalised as a whole before the rotary."""

    def __init__(self, config, layer_index, ctx, prefix, sliding_window=None, rope=None):
        super().__init__(config, layer_index, ctx, prefix, sliding_window=sliding_window, rope=rope)
        heads, kv_heads = self.total_num_heads, self.total_num_kv_heads
        q_part, kv_part = self.qkv_proj.output_parts[0], self.qkv_proj.output_parts[1]
        self.q_norm = ProjectionNorm(heads * self.head_dim, q_part, 1, config.rms_norm_eps, ctx)
        self.k_norm = ProjectionNorm(kv_heads * self.head_dim, kv_part, max(1, tp_size() // kv_heads),
                                     config.rms_norm_eps, ctx)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn.forward_rotary(positions, self.q_norm(q), self.k_norm(k), v, self.rotary_emb))


class Olmo2DecoderLayer(LlamaDecoderLayer):
    """``h + norm(attention(h))``, then ``h + norm(mlp(h))``; the next layer (or the final norm) adds the last.
    Each block sums its own output under tensor parallelism: the norm after it needs the whole."""

    def __init__(self, config, layer_index: int, ctx: ModelContext, prefix: str):
        nn.Module.__init__(self)
        self.self_attn = self.make_attention(config, layer_index, ctx, f"{prefix}.self_attn")
        self.mlp = self.make_mlp(config, layer_index, ctx, f"{prefix}.mlp")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)

    def make_attention(self, config, layer_index, ctx, prefix):
        return Olmo2Attention(config, layer_index, ctx, prefix)

    def can_leave_outputs_unreduced(self) -> bool:
        return False

    def forward_steps(self, positions, hidden_states, residual):
        if residual is not None:
            hidden_states = hidden_states + residual
        hidden_states = hidden_states + self.post_attention_layernorm(self.self_attn(positions, hidden_states))
        yield
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), hidden_states


class Olmo2Model(LlamaModel):
    """Llama's model with OLMo 2's layers."""

    layer_cls = Olmo2DecoderLayer


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2 causal LM."""

    model_cls = Olmo2Model
    example_models = ("allenai/OLMo-2-1124-7B-Instruct", "allenai/OLMo-2-0425-1B-Instruct")
    features = ("norms after attention and MLP", "q/k norm over all heads", "GQA")


class Olmo3DecoderLayer(Olmo2DecoderLayer):
    """OLMo 2's layer with a window and a rope from ``layer_types``."""

    sliding_window = staticmethod(window_from_layer_types)

    def make_attention(self, config, layer_index, ctx, prefix):
        return Olmo2Attention(config, layer_index, ctx, prefix, sliding_window=self.sliding_window(config, layer_index),
                              rope=rope_parameters(config, config.layer_types[layer_index]))


class Olmo3Model(LlamaModel):
    """Llama's model with OLMo 3's layers."""

    layer_cls = Olmo3DecoderLayer


class Olmo3ForCausalLM(LlamaForCausalLM):
    """OLMo 3 causal LM."""

    model_cls = Olmo3Model
    example_models = ("allenai/Olmo-3-7B-Instruct", "allenai/Olmo-3-1125-32B")
    features = ("sliding-window layers (rope per layer type)", "norms after attention and MLP",
                "q/k norm over all heads", "GQA")
