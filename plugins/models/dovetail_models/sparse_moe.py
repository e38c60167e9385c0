"""The sparse mixture-of-experts block of Qwen 3 MoE and Mixtral: a router and the fused experts."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from dovetail.layers.linear import Linear
from dovetail.layers.moe import FusedMoE
from dovetail.model_interface import ModelContext
from dovetail.quantization.unquantized import UnquantizedMethod


class SparseMoeBlock(nn.Module):
    """``gate`` scores the experts of each token (never quantized); ``experts`` runs the top-k of them.

    Parameter names follow HF checkpoints: ``<prefix>.gate.weight`` and
    ``<prefix>.experts.<e>.<projection>.weight``.
    """

    def __init__(self, config, ctx: ModelContext, prefix: str, num_experts: int, top_k: int,
                 intermediate_size: int, renormalize: bool):
        super().__init__()
        self.gate = Linear(config.hidden_size, num_experts, False, replace(ctx, quant=UnquantizedMethod()),
                           f"{prefix}.gate")
        self.experts = FusedMoE(num_experts, top_k, config.hidden_size, intermediate_size, ctx,
                                f"{prefix}.experts", renormalize=renormalize, activation=config.hidden_act)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))
