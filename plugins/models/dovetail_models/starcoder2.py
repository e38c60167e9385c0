"""StarCoder 2: LayerNorms with biases, biases on every projection (``use_bias``), and an MLP without a gate
(``c_fc``, ``gelu_pytorch_tanh``, ``c_proj``); a sliding window on every layer when the config sets one."""

from __future__ import annotations

import torch
from torch import nn

from dovetail.layers.activation import PlainActivation
from dovetail.layers.linear import ColumnParallelLinear, RowParallelLinear
from dovetail.layers.norm import LayerNorm
from dovetail.model_interface import ModelContext
from dovetail_models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, window_on_every_layer


class Starcoder2MLP(nn.Module):
    """``c_proj(act(c_fc(x)))``, column- then row-parallel."""

    def __init__(self, config, ctx: ModelContext, prefix: str):
        super().__init__()
        self.c_fc = ColumnParallelLinear(config.hidden_size, config.intermediate_size, config.use_bias, ctx,
                                         f"{prefix}.c_fc")
        self.c_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, config.use_bias, ctx,
                                        f"{prefix}.c_proj")
        self.act = PlainActivation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    """Pre-LayerNorm attention and MLP blocks, each reducing its own output under tensor parallelism."""

    sliding_window = staticmethod(window_on_every_layer)

    def __init__(self, config, layer_index: int, ctx: ModelContext, prefix: str):
        nn.Module.__init__(self)
        self.self_attn = LlamaAttention(config, layer_index, ctx, f"{prefix}.self_attn", qkv_bias=config.use_bias,
                                        o_bias=config.use_bias,
                                        sliding_window=self.sliding_window(config, layer_index))
        self.mlp = Starcoder2MLP(config, ctx, f"{prefix}.mlp")
        self.input_layernorm = LayerNorm(config.hidden_size, config.norm_epsilon, ctx)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.norm_epsilon, ctx)

    def can_leave_outputs_unreduced(self) -> bool:
        return False  # a LayerNorm does not sum partial outputs


class Starcoder2Model(LlamaModel):
    """Llama's model with StarCoder 2's layers and a final LayerNorm."""

    layer_cls = Starcoder2DecoderLayer

    @classmethod
    def make_norm(cls, config, ctx: ModelContext) -> nn.Module:
        return LayerNorm(config.hidden_size, config.norm_epsilon, ctx)


class Starcoder2ForCausalLM(LlamaForCausalLM):
    """StarCoder 2 causal LM (embeddings tied to the LM head by default)."""

    model_cls = Starcoder2Model
    example_models = ("bigcode/starcoder2-3b", "bigcode/starcoder2-7b", "bigcode/starcoder2-15b")
    features = ("LayerNorm", "biases (`use_bias`)", "MLP without a gate", "sliding window", "GQA",
                "tied embeddings")
