"""Granite (IBM Granite 3): Llama with four multipliers. Embeddings are scaled by ``embedding_multiplier``,
attention scores by ``attention_multiplier`` (in place of ``head_dim ** -0.5``), each block's output by
``residual_multiplier`` before the residual add, and the logits divided by ``logits_scaling``."""

from __future__ import annotations

import torch

from dovetail.layers.norm import RMSNorm
from dovetail_models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel


class GraniteAttention(LlamaAttention):
    """Llama's attention scaled by ``attention_multiplier``, its output by ``residual_multiplier``."""

    def __init__(self, config, layer_index, ctx, prefix):
        super().__init__(config, layer_index, ctx, prefix, scale=config.attention_multiplier)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().forward(positions, hidden_states) * self.residual_multiplier  # partial sums scale alike


class GraniteMLP(LlamaMLP):
    """Llama's MLP, its output scaled by ``residual_multiplier``."""

    def __init__(self, config, ctx, prefix):
        super().__init__(config, ctx, prefix)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.residual_multiplier


class GraniteDecoderLayer(LlamaDecoderLayer):
    """A Llama layer of Granite's attention and MLP."""

    def make_attention(self, config, layer_index, ctx, prefix):
        return GraniteAttention(config, layer_index, ctx, prefix)

    def make_mlp(self, config, layer_index, ctx, prefix):
        return GraniteMLP(config, ctx, prefix)


class LogitScaledNorm(RMSNorm):
    """The final norm with ``1 / logits_scaling`` folded into its weight: the LM head is linear, so dividing
    its input divides the logits, at no cost."""

    def __init__(self, hidden_size, eps, ctx, logits_scaling: float):
        super().__init__(hidden_size, eps, ctx)
        self.logits_scaling = logits_scaling

    def process_weights_after_loading(self) -> None:
        super().process_weights_after_loading()
        self.weight.data.div_(self.logits_scaling)


class GraniteModel(LlamaModel):
    """Embeddings scaled by ``embedding_multiplier``, Granite layers, the logit scaling in the final norm."""

    layer_cls = GraniteDecoderLayer

    @classmethod
    def make_norm(cls, config, ctx) -> RMSNorm:
        return LogitScaledNorm(config.hidden_size, config.rms_norm_eps, ctx, config.logits_scaling)

    @classmethod
    def embedding_scale(cls, config) -> float:
        return config.embedding_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite causal LM."""

    model_cls = GraniteModel
    example_models = ("ibm-granite/granite-3.3-8b-instruct", "ibm-granite/granite-3.1-2b-instruct")
    features = ("embedding, attention, residual and logit multipliers", "GQA", "tied embeddings")
