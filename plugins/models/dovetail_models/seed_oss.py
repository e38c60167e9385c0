"""Seed-OSS (ByteDance): Llama with the output projection's bias set apart (``attention_out_bias``) from the
query/key/value projections' (``attention_bias``), and an explicit ``head_dim``."""

from __future__ import annotations

from dovetail_models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class SeedOssDecoderLayer(LlamaDecoderLayer):
    """A Llama layer whose output projection has a bias of its own."""

    def make_attention(self, config, layer_index, ctx, prefix):
        return LlamaAttention(config, layer_index, ctx, prefix, o_bias=config.attention_out_bias)


class SeedOssModel(LlamaModel):
    """Llama's model with Seed-OSS's layers."""

    layer_cls = SeedOssDecoderLayer


class SeedOssForCausalLM(LlamaForCausalLM):
    """Seed-OSS causal LM."""

    model_cls = SeedOssModel
    example_models = ("ByteDance-Seed/Seed-OSS-36B-Instruct",)
    features = ("GQA", "QKV bias", "explicit head_dim")
