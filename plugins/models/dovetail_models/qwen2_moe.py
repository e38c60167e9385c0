"""Qwen2-MoE (and Qwen1.5-MoE): Qwen 2's attention, and sparse MoE blocks with a gated shared expert."""

from __future__ import annotations

from dovetail_models.llama import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel,
                                   window_from_layer_types)
from dovetail_models.qwen3_moe import is_sparse_layer
from dovetail_models.sparse_moe import SparseMoeBlock


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    """Qwen 2's attention (QKV bias as ``qkv_bias`` says, windows from ``layer_types``); a sparse MoE block with a
    sigmoid-gated shared expert, or a dense MLP (``intermediate_size``) on the layers the config leaves dense."""

    sliding_window = staticmethod(window_from_layer_types)

    def make_attention(self, config, layer_index, ctx, prefix):
        return LlamaAttention(config, layer_index, ctx, prefix, qkv_bias=getattr(config, "qkv_bias", True),
                              sliding_window=self.sliding_window(config, layer_index))

    def make_mlp(self, config, layer_index, ctx, prefix):
        if is_sparse_layer(config, layer_index):
            return SparseMoeBlock(config, ctx, prefix, config.num_experts, config.num_experts_per_tok,
                                  config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob),
                                  shared_intermediate_size=config.shared_expert_intermediate_size, shared_gate=True)
        return LlamaMLP(config, ctx, prefix, intermediate_size=config.intermediate_size)


class Qwen2MoeModel(LlamaModel):
    """Llama's model with Qwen2-MoE's layers."""

    layer_cls = Qwen2MoeDecoderLayer


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE causal LM."""

    model_cls = Qwen2MoeModel
    example_models = ("Qwen/Qwen1.5-MoE-A2.7B-Chat", "Qwen/Qwen2-57B-A14B-Instruct")
    features = ("MoE (top-k, `norm_topk_prob`)", "shared expert with a sigmoid gate", "QKV bias",
                "dense layers from `mlp_only_layers`/`decoder_sparse_step`")
