"""FP8 mixture-of-experts checkpoints: Qwen3-MoE in the layout of Qwen's FP8 releases (128 x 128 block scales
``weight_scale_inv``, dynamic activations; smaller blocks here, as the model is tiny), per-tensor ``weight_scale``
experts, and ``--quantization fp8`` on a float checkpoint; loaded through ``LLM`` like any model.

Checks, as tests/test_quant_checkpoints.py does for dense models: each MoE layer against the float math on the
test's own dequantisation of the tensors it wrote; the model against HF transformers running those dequantised
weights in float32 (teacher-forced, activation quantization being the only difference); and against the float
model (quantization noise, not a mis-read layout).
"""

from __future__ import annotations

import pytest
import torch

import test_quant_checkpoints as quant
import tiny_models
from dovetail import LLM
from dovetail.errors import ConfigError
from dovetail.moe_ops import moe_reference, select_experts

FP8 = torch.float8_e4m3fn
BLOCK = (16, 16)


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                            max_position_embeddings=256, initializer_range=0.1, bos_token_id=0, eos_token_id=1)
    return tiny_models.save_model(tmp_path_factory.mktemp("moe-float"), config)


@pytest.fixture(scope="module")
def float_reference(float_dir):
    return _reference(LLM(str(float_dir), **quant.ENGINE))


def _reference(llm):
    from dovetail import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=quant.NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in quant.PROMPTS], params, use_tqdm=False)
    sequences = [p + o.outputs[0].token_ids for p, o in zip(quant.PROMPTS, outs)]
    return sequences, quant.teacher_forced(llm, sequences)


def block_fp8(w: torch.Tensor, block: tuple[int, int]):
    """Qwen's / DeepSeek's layout: FP8 weight and one ``weight_scale_inv`` per block; and the dequantised weight."""
    (bn, bk), (n, k) = block, w.shape
    blocks = w.float().reshape(n // bn, bn, k // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    q = (blocks / scale[:, None, :, None]).reshape(n, k).to(FP8)
    return q, scale, q.float() * scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)


def build(src, dst, scheme: str):
    """Every decoder linear, experts included, quantized (the routers, embeddings and LM head left in float)."""
    tensors, refs = quant.float_tensors(src), {}
    for module, _, w in list(quant.linear_weights(tensors)):
        if scheme == "block":
            q, scale, refs[module] = block_fp8(w, BLOCK)
            tensors[f"{module}.weight"], tensors[f"{module}.weight_scale_inv"] = q, scale
        else:
            q, scale, refs[module] = quant.fp8_per_tensor(w)
            tensors[f"{module}.weight"], tensors[f"{module}.weight_scale"] = q, scale.reshape(())
    config = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if scheme == "block":
        config.update(fmt="e4m3", weight_block_size=list(BLOCK))
    return quant.write_checkpoint(src, dst, tensors, config), refs


def check_moe_layers(llm, refs):
    """Each loaded MoE layer against the float experts on the dequantised weights (FP8 activations aside)."""
    model = llm.llm_engine.model
    gen = torch.Generator().manual_seed(2)
    for layer_index in range(2):
        prefix = f"model.layers.{layer_index}.mlp.experts"
        layer = model.get_submodule(prefix)
        assert layer.w13_weight.dtype == FP8 and layer.w2_weight.dtype == FP8
        experts = range(layer.num_experts)
        w13 = torch.stack([torch.cat([refs[f"{prefix}.{e}.gate_proj"], refs[f"{prefix}.{e}.up_proj"]]) for e in experts])
        w2 = torch.stack([refs[f"{prefix}.{e}.down_proj"] for e in experts])
        x, logits = torch.randn(7, 64, generator=gen), torch.randn(7, 4, generator=gen)
        with torch.no_grad():
            out = layer(x, logits)
        expected = moe_reference(x, w13, w2, *select_experts(logits, 2, True))
        err = float((out - expected).abs().max() / expected.abs().max())
        assert err <= quant.LAYER_BOUND["fp8"], f"{prefix}: relative error {err:.2e}"


@pytest.mark.parametrize("scheme", ["block", "per-tensor"])
def test_fp8_qwen3_moe_checkpoint(float_dir, float_reference, tmp_path, scheme):
    path, refs = build(float_dir, tmp_path / scheme, scheme)
    llm = LLM(str(path), **quant.ENGINE)
    experts = llm.llm_engine.model.get_submodule("model.layers.0.mlp.experts")
    if scheme == "block":
        assert experts.w13_weight_scale.shape == (4, 2 * 32 // 16, 64 // 16)
    else:
        assert experts.w13_weight_scale.shape == (4, 64)  # a per-tensor scale repeated over gate's and up's rows
    assert llm.llm_engine.model.get_submodule("model.layers.0.mlp.gate").weight.dtype == torch.float32
    check_moe_layers(llm, refs)
    quant.check_model(llm, float_dir, refs, tmp_path, "fp8", float_reference)


def test_fp8_at_load_quantizes_the_experts_per_channel(float_dir, float_reference):
    llm = LLM(str(float_dir), quantization="fp8", **quant.ENGINE)
    experts = llm.llm_engine.model.get_submodule("model.layers.1.mlp.experts")
    assert experts.w13_weight.dtype == FP8 and experts.w2_weight_scale.shape == (4, 64)
    refs = {}
    for name, w in quant.float_tensors(float_dir).items():
        if ".experts." in name:
            refs[name.removesuffix(".weight")] = quant.fp8_per_channel(w)[2]
    check_moe_layers(llm, refs)
    top1, _ = quant.model_agreement(llm, float_reference)
    assert top1 >= quant.MIN_TOP1_VS_FLOAT["fp8"]


def test_static_activation_scales_are_refused_for_experts(float_dir, tmp_path):
    path, _ = build(float_dir, tmp_path / "static", "per-tensor")
    config = (path / "config.json").read_text().replace('"dynamic"', '"static"')
    (path / "config.json").write_text(config)
    with pytest.raises(ConfigError, match=r"activation_scheme: 'static' activation scales are not supported for "
                                          r"mixture-of-experts layers \(model.layers.0.mlp.experts\)"):
        LLM(str(path), **quant.ENGINE)


def tp_moe_run(path: str) -> tuple[tuple, list]:
    """On each rank of two (tests/spmd.py): the experts' stacked FP8 shapes and the greedy completions."""
    llm = LLM(path, cpu_threads=1, **quant.ENGINE)
    experts = llm.llm_engine.model.get_submodule("model.layers.0.mlp.experts")
    shapes = tuple(tuple(getattr(experts, n).shape) for n in ("w13_weight", "w13_weight_scale", "w2_weight"))
    return shapes, tiny_models.completions(llm.generate([{"prompt_token_ids": p} for p in quant.PROMPTS],
                                                        quant.TP_PARAMS, use_tqdm=False))


def test_fp8_moe_checkpoint_at_tensor_parallel_2_matches_one_rank(float_dir, tmp_path, tp_ranks):
    """Expert parallelism with FP8 block experts: each of two ranks holds two of the four experts (weights and
    scales) and the ranks generate what one rank does (each expert is whole on its rank, so its activations
    are quantized as on one rank; the attention's row-parallel sums are not, hence the W8A8 tolerance)."""
    path, _ = build(float_dir, tmp_path / "fp8-moe", "block")
    llm = LLM(str(path), **quant.ENGINE)
    one_rank = tiny_models.completions(llm.generate([{"prompt_token_ids": p} for p in quant.PROMPTS],
                                                    quant.TP_PARAMS, use_tqdm=False))
    experts = llm.llm_engine.model.get_submodule("model.layers.0.mlp.experts")
    whole = [tuple(getattr(experts, n).shape) for n in ("w13_weight", "w13_weight_scale", "w2_weight")]
    (shapes, results), (shapes_1, results_1) = tp_ranks(2).run(tp_moe_run, str(path))
    assert results == results_1, "the ranks sampled different tokens or log-probabilities"
    tiny_models.check_matches(results, one_rank, tol=quant.TP_TOLERANCE["w8a8"])
    assert shapes == shapes_1 == tuple((2, *shape[1:]) for shape in whole)
