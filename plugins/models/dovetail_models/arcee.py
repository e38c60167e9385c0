"""Arcee (AFM): Llama with an MLP without a gate, ``down(relu(up(x)) ** 2)``."""

from __future__ import annotations

import torch
from torch import nn

from dovetail.layers.activation import PlainActivation
from dovetail.layers.linear import ColumnParallelLinear, RowParallelLinear
from dovetail.model_interface import ModelContext
from dovetail_models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class ArceeMLP(nn.Module):
    """``down_proj(act(up_proj(x)))``, column- then row-parallel; its output may be left unreduced."""

    def __init__(self, config, ctx: ModelContext, prefix: str):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.up_proj = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias, ctx,
                                            f"{prefix}.up_proj")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias, ctx,
                                           f"{prefix}.down_proj")
        self.act = PlainActivation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))

    def leave_output_unreduced(self) -> None:
        """Return this rank's partial sum; the norm after it all-reduces it (see :class:`LlamaModel`)."""
        self.down_proj.reduce_results = False


class ArceeDecoderLayer(LlamaDecoderLayer):
    """A Llama layer with Arcee's MLP."""

    def make_mlp(self, config, layer_index, ctx, prefix):
        return ArceeMLP(config, ctx, prefix)


class ArceeModel(LlamaModel):
    """Llama's model with Arcee's layers."""

    layer_cls = ArceeDecoderLayer


class ArceeForCausalLM(LlamaForCausalLM):
    """Arcee causal LM."""

    model_cls = ArceeModel
    example_models = ("arcee-ai/AFM-4.5B",)
    features = ("MLP without a gate (squared ReLU)", "GQA", "rope scaling (yarn)")
