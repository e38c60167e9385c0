"""Core layers the zoo relies on, against HF's modules in bfloat16 (where rounding order shows)."""

from __future__ import annotations

import torch

from dovetail.layers.embedding import VocabEmbedding
from dovetail.layers.norm import RMSNorm
from dovetail.model_interface import ModelContext
from dovetail.model_loader import fill_dummy_weights
from dovetail.ops import FusedOps
from dovetail.quantization.unquantized import UnquantizedMethod


def _ctx(dtype=torch.bfloat16) -> ModelContext:
    return ModelContext(dtype=dtype, device=torch.device("cpu"), quant=UnquantizedMethod(), attention_backend=None,
                        ops=FusedOps())


def test_gemma_embedding_scale_is_rounded_to_the_model_dtype_like_hf():
    from transformers.models.gemma2.modeling_gemma2 import Gemma2TextScaledWordEmbedding

    hf = Gemma2TextScaledWordEmbedding(50, 3072, 0, embed_scale=3072**0.5).to(torch.bfloat16)
    ours = VocabEmbedding(50, 3072, _ctx(), scale=3072**0.5)
    ours.weight.data.copy_(hf.weight.data)
    assert ours.scale == 55.5, "sqrt(3072) = 55.4256 rounds to 55.5 in bfloat16"
    ids = torch.tensor([0, 7, 49, 7])
    assert torch.equal(ours(ids), hf(ids))


def test_one_plus_weight_norm_matches_hf_gemma_norm_in_bfloat16():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    hf = Gemma3RMSNorm(64, eps=1e-6)
    torch.nn.init.normal_(hf.weight, std=0.5)
    hf = hf.to(torch.bfloat16)
    ours = RMSNorm(64, 1e-6, _ctx(), weight_offset=1.0)
    ours.weight.data.copy_(hf.weight.data)
    ours.process_weights_after_loading()
    x, residual = torch.randn(5, 64).to(torch.bfloat16), torch.randn(5, 64).to(torch.bfloat16)
    assert torch.equal(ours(x), hf(x))
    normed, summed = ours(x, residual)
    assert torch.equal(summed, x + residual) and torch.equal(normed, hf(x + residual))


def test_dummy_weights_leave_one_plus_weight_norms_at_one():
    norm = RMSNorm(8, 1e-6, _ctx(torch.float32), weight_offset=1.0)
    fill_dummy_weights(torch.nn.ModuleDict({"norm": norm}))
    norm.process_weights_after_loading()
    assert torch.equal(norm.weight, torch.ones(8))
