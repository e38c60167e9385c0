"""Mixtral: Mistral's attention with a sparse MoE block (top-k, renormalized) on every layer."""

from __future__ import annotations

from dovetail_models.llama import LlamaForCausalLM, LlamaModel
from dovetail_models.mistral import MistralDecoderLayer
from dovetail_models.sparse_moe import SparseMoeBlock


class MixtralDecoderLayer(MistralDecoderLayer):
    """Sliding-window attention (when set) and a sparse MoE block of ``num_local_experts`` experts."""

    def make_mlp(self, config, layer_index, ctx, prefix):
        return SparseMoeBlock(config, ctx, prefix, config.num_local_experts, config.num_experts_per_tok,
                              config.intermediate_size, renormalize=True)


class MixtralModel(LlamaModel):
    """Llama's model with Mixtral's layers."""

    layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral causal LM.

    Hub checkpoints name the MoE block ``block_sparse_moe`` and the experts'
    projections ``w1`` (gate), ``w3`` (up) and ``w2`` (down).
    """

    model_cls = MixtralModel
    rename_weights = ((r"\.block_sparse_moe\.", ".mlp."),)
    example_models = ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mistralai/Mixtral-8x22B-Instruct-v0.1")
    features = ("MoE (top-k, renormalized)", "GQA", "sliding window")
