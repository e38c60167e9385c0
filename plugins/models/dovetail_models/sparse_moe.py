"""The sparse mixture-of-experts block of Qwen-MoE, Mixtral and DeepSeek-style models: a router, the fused
experts, and optionally shared experts that every token goes through."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from dovetail.distributed import all_reduce, tp_size
from dovetail.layers.linear import Linear
from dovetail.layers.moe import FusedMoE
from dovetail.model_interface import ModelContext
from dovetail.moe_ops import ExpertOutputs
from dovetail.quantization.unquantized import UnquantizedMethod
from dovetail_models.llama import LlamaMLP


class SparseMoeBlock(nn.Module):
    """``gate`` scores the experts of each token (never quantized); ``experts`` runs the top-k of them.

    Under tensor parallelism the router is replicated, the experts are divided among the ranks (expert
    parallelism) and the shared expert is split like a dense MLP; one all-reduce sums the block's parts.

    With ``shared_intermediate_size`` every token also goes through a dense gated MLP of that width
    (Qwen2-MoE's ``shared_expert``, DeepSeek's ``shared_experts``: ``shared_name``), added to the experts'
    sum; ``shared_gate`` scales it first by ``sigmoid(shared_expert_gate(x))``, one unquantized scalar per token
    (Qwen2-MoE).

    Parameter names follow HF checkpoints: ``<prefix>.gate.weight``, ``<prefix>.experts.<e>.<projection>.weight``,
    ``<prefix>.<shared_name>.{gate,up,down}_proj.weight`` and ``<prefix>.shared_expert_gate.weight``.
    """

    def __init__(self, config, ctx: ModelContext, prefix: str, num_experts: int, top_k: int,
                 intermediate_size: int, renormalize: bool, shared_intermediate_size: int = 0,
                 shared_gate: bool = False, shared_name: str = "shared_expert"):
        super().__init__()
        unquantized = replace(ctx, quant=UnquantizedMethod())
        self.gate = Linear(config.hidden_size, num_experts, False, unquantized, f"{prefix}.gate")
        # Under tensor parallelism the experts' and the shared expert's partial sums are all-reduced once, here.
        self.experts = FusedMoE(num_experts, top_k, config.hidden_size, intermediate_size, ctx,
                                f"{prefix}.experts", renormalize=renormalize, activation=config.hidden_act,
                                reduce_results=False)
        self.reduce_results = tp_size() > 1
        self.shared_name = shared_name if shared_intermediate_size else None
        if self.shared_name:
            setattr(self, shared_name, LlamaMLP(config, ctx, f"{prefix}.{shared_name}",
                                                intermediate_size=shared_intermediate_size,
                                                size_field="shared_expert_intermediate_size", reduce_results=False))
        self.shared_expert_gate = (Linear(config.hidden_size, 1, False, unquantized, f"{prefix}.shared_expert_gate")
                                   if self.shared_name and shared_gate else None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | ExpertOutputs:
        out = self.experts(hidden_states, self.gate(hidden_states))
        if self.shared_name is not None:
            shared = getattr(self, self.shared_name)(hidden_states)
            if self.shared_expert_gate is not None:  # the same scalar on every rank: it scales the partial sums
                shared = torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared
            out = out + shared
        return all_reduce(out) if self.reduce_results else out

    def leave_expert_sum_to_norm(self) -> None:
        """The block's output goes straight into a norm, which may sum the experts' outputs in its own kernel
        (:class:`~dovetail.layers.moe.FusedMoE`'s ``leave_sum_to_norm``): without a shared expert or an
        all-reduce, the experts' output is the block's."""
        if self.shared_name is None and not self.reduce_results:
            self.experts.leave_sum_to_norm = True

    def leave_output_unreduced(self) -> None:
        """Return this rank's partial sum; the norm after it all-reduces it."""
        self.reduce_results = False
