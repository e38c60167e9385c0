"""Qwen 3 MoE: Qwen 3's attention, and sparse MoE blocks on the layers the config selects."""

from __future__ import annotations

from dovetail_models.llama import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel,
                                   window_on_every_layer)
from dovetail_models.sparse_moe import SparseMoeBlock


def is_sparse_layer(config, layer_index: int) -> bool:
    """HF's rule: MoE unless listed in ``mlp_only_layers``, on every ``decoder_sparse_step``-th layer."""
    return (layer_index not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_index + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    """q/k-normed attention; a sparse MoE block or a dense MLP (``intermediate_size``)."""

    sliding_window = staticmethod(window_on_every_layer)

    def make_attention(self, config, layer_index, ctx, prefix):
        return LlamaAttention(config, layer_index, ctx, prefix, qk_norm_offset=0.0,
                              sliding_window=self.sliding_window(config, layer_index))

    def make_mlp(self, config, layer_index, ctx, prefix):
        if is_sparse_layer(config, layer_index):
            return SparseMoeBlock(config, ctx, prefix, config.num_experts, config.num_experts_per_tok,
                                  config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob))
        return LlamaMLP(config, ctx, prefix, intermediate_size=config.intermediate_size)


class Qwen3MoeModel(LlamaModel):
    """Llama's model with Qwen 3 MoE's layers."""

    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen 3 mixture-of-experts causal LM."""

    model_cls = Qwen3MoeModel
    example_models = ("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-235B-A22B")
    features = ("MoE (top-k, `norm_topk_prob`)", "dense layers from `mlp_only_layers`/`decoder_sparse_step`",
                "q/k norm", "explicit head_dim")
