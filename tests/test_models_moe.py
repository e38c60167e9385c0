"""The fused mixture-of-experts layer: routing against HF, the fused path against the reference, loading."""

from __future__ import annotations

import json

import pytest
import torch

from dovetail.errors import ModelLoadError, SelectionError
from dovetail.layers.moe import FusedMoE
from dovetail.moe_ops import fused_experts, moe_reference, select_experts
from dovetail.layers.weights import WeightMapper
from dovetail.model_interface import ModelContext
from dovetail.ops import FusedOps
from dovetail.quantization.unquantized import UnquantizedMethod


def _random_moe(tokens: int, experts: int, top_k: int, hidden: int = 24, inter: int = 16, seed: int = 0,
                dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.3).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.3).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen).to(dtype)
    return x, w13, w2, logits


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (7, 4, 2), (33, 8, 3), (5, 6, 6)])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_fused_path_matches_reference(tokens, experts, top_k, activation):
    x, w13, w2, logits = _random_moe(tokens, experts, top_k, seed=tokens)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    expected = moe_reference(x, w13, w2, weights, ids, activation)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids, activation), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(FusedOps().fused_moe(x, w13, w2, weights, ids, activation), expected,
                               rtol=1e-5, atol=1e-5)


def test_fused_path_matches_reference_in_bfloat16():
    x, w13, w2, logits = _random_moe(9, 8, 2, dtype=torch.bfloat16)
    weights, ids = select_experts(logits, 2, renormalize=False)
    out = fused_experts(x, w13, w2, weights, ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, moe_reference(x, w13, w2, weights, ids), rtol=2e-2, atol=2e-2)


def test_reference_is_the_weighted_sum_of_the_chosen_experts():
    x, w13, w2, _ = _random_moe(2, 3, 2)
    ids = torch.tensor([[2, 0], [1, 2]])
    weights = torch.tensor([[0.7, 0.3], [0.4, 0.6]])

    def expert(e, v):
        gate, up = (w13[e] @ v).chunk(2)
        return w2[e] @ (torch.nn.functional.silu(gate) * up)

    expected = torch.stack([0.7 * expert(2, x[0]) + 0.3 * expert(0, x[0]),
                            0.4 * expert(1, x[1]) + 0.6 * expert(2, x[1])])
    torch.testing.assert_close(moe_reference(x, w13, w2, weights, ids), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_routing_matches_hf_qwen3_moe(norm_topk_prob):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=24, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob)
    router = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(11, 24)
    logits, hf_weights, hf_ids = router(x)
    weights, ids = select_experts(logits, 3, renormalize=norm_topk_prob)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights.float())


def test_routing_matches_hf_mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    router = MixtralTopKRouter(MixtralConfig(hidden_size=24, num_local_experts=6, num_experts_per_tok=2))
    torch.nn.init.normal_(router.weight, std=0.5)
    logits, hf_weights, hf_ids = router(torch.randn(9, 24))
    weights, ids = select_experts(logits, 2, renormalize=True)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights)


def _ctx(quant=None) -> ModelContext:
    return ModelContext(dtype=torch.float32, device=torch.device("cpu"), quant=quant or UnquantizedMethod(),
                        attention_backend=None, ops=FusedOps())


class _Block(torch.nn.Module):
    def __init__(self, experts=3):
        super().__init__()
        self.experts = FusedMoE(experts, 2, 8, 4, _ctx(), "block.experts")


def test_per_expert_tensors_load_into_the_stacked_weights_and_report_completion():
    block = _Block()
    w13, w2 = torch.randn(3, 8, 8), torch.randn(3, 8, 4)
    names = []
    for e in range(3):
        names += [(f"experts.{e}.gate_proj.weight", w13[e, :4]), (f"experts.{e}.up_proj.weight", w13[e, 4:]),
                  (f"experts.{e}.down_proj.weight", w2[e])]
    loaded = WeightMapper(block).load(names[:-1])
    assert loaded == {"experts.w13_weight"}, "w2 is still missing one expert"
    loaded = WeightMapper(block).load(names)
    assert loaded == {"experts.w13_weight", "experts.w2_weight"}
    assert torch.equal(block.experts.w13_weight, w13) and torch.equal(block.experts.w2_weight, w2)


@pytest.mark.parametrize("name,shape,message", [
    ("experts.3.gate_proj.weight", (4, 8), r"names expert 3, but block.experts has 3 experts"),
    ("experts.0.up_proj.weight", (5, 8), r"'experts.0.up_proj.weight' has shape \(5, 8\).*expects \(4, 8\)"),
    ("experts.0.router_proj.weight", (4, 8), r"expert projection 'router_proj' is not one of"),
    ("experts.down_proj", (3, 8, 5), r"has shape \(3, 8, 5\).*expects \(3, 8, 4\)"),
])
def test_bad_expert_tensors_are_named(name, shape, message):
    with pytest.raises(ModelLoadError, match=message):
        WeightMapper(_Block()).load([(name, torch.zeros(shape))])


def test_a_quantization_method_that_cannot_quantize_experts_is_refused():
    class FakeQuant(UnquantizedMethod):
        """A quantization method that claims every layer, MoE experts included."""

        name = "fakeq"

    with pytest.raises(SelectionError, match=r"quantization 'fakeq' cannot run this model.*model.layers.0.mlp"):
        FusedMoE(4, 2, 8, 4, _ctx(FakeQuant()), "model.layers.0.mlp.experts")


def test_bad_top_k_is_named():
    with pytest.raises(ModelLoadError, match="num_experts_per_tok must be between 1 and the number of experts"):
        FusedMoE(4, 5, 8, 4, _ctx(), "m.experts")


@pytest.mark.parametrize("config_name,overrides", [
    ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
    ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
])
def test_transformers5_stacked_expert_layout_loads(tmp_path, config_name, overrides):
    """transformers 5 keeps every expert in one tensor in memory; a checkpoint saved from that state loads too."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    import test_models_vs_hf as common
    from tiny_models import build_tokenizer, completions, hf_greedy

    config = common._config(config_name, **overrides)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    config.architectures = [type(hf).__name__]
    config.save_pretrained(str(tmp_path))
    build_tokenizer(tmp_path, vocab_size=300)
    assert "architectures" in json.loads((tmp_path / "config.json").read_text())
    prompts = common.PROMPTS[:2]
    reference = [hf_greedy(hf, p, common.MAX_TOKENS) for p in prompts]
    _, outputs = common.run_engine(tmp_path, prompts)
    common.check_matches_hf(completions(outputs), reference)


class _UnsummedTorchOps(FusedOps):
    """The torch definitions, with the experts' outputs left unsummed for the norm after them, as the GPU
    platforms' ops leave them (:meth:`FusedOps.routed_moe_unsummed`)."""

    def __init__(self):
        super().__init__()
        self.unsummed = 0

    def routed_moe_unsummed(self, x, router_logits, w13, w2, top_k, renormalize, activation="silu", fp8=None):
        from dovetail.moe_ops import ExpertOutputs, act_and_mul

        weights, ids = self.select_experts(router_logits, top_k, renormalize)
        experts = ids.reshape(-1)
        rows = x.repeat_interleave(top_k, dim=0)
        hidden = act_and_mul(torch.einsum("ph,pih->pi", rows, w13[experts]), activation)
        self.unsummed += 1
        return ExpertOutputs(torch.einsum("pi,phi->ph", hidden, w2[experts]), weights)


@pytest.mark.parametrize("case,sums_in_the_norm", [("qwen3moe-normtopk-dense-layer", True), ("mixtral-sliding", True),
                                                   ("qwen2moe-shared-expert-dense-layer", False)])
def test_the_norm_after_an_moe_block_sums_its_experts(tmp_path, case, sums_in_the_norm):
    """On one rank an MoE block without a shared expert hands its experts' outputs to the next norm unsummed
    (dense layers in between, the final norm after the last): greedy tokens and log-probabilities as HF's.
    A block with a shared expert adds it to the experts' sum and hands on a tensor."""
    from dovetail import LLM, SamplingParams
    from test_models_vs_hf import CASES, MAX_TOKENS, PROMPTS, check_matches_hf, save_checkpoint
    from tiny_models import completions, hf_greedy, load_hf

    path = save_checkpoint(tmp_path / case, CASES[case]())
    hf = load_hf(path)
    reference = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    llm = LLM(str(path), attention_backend="REFERENCE", max_model_len=256, num_gpu_blocks_override=64, block_size=4)
    layers = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, FusedMoE)]
    assert layers and all(layer.leave_sum_to_norm == sums_in_the_norm for layer in layers)
    ops = _UnsummedTorchOps()
    for layer in layers:
        layer.ops = ops
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    check_matches_hf(completions(outputs), reference)
    assert (ops.unsummed > 0) == sums_in_the_norm
