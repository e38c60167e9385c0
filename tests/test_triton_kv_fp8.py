"""TRITON with an FP8 (e4m3) KV cache: the writes quantise with the layer's scales, the attention dequantises.

Two references on random inputs (never zeros), in triton's CPU interpreter without a GPU:

- exact: REFERENCE on the float cache the FP8 one stands for (every cached and new key and value rounded
  through e4m3 with its scale, as vLLM stores them): TRITON must match it as closely as with a float cache;
- stated tolerance: REFERENCE on the unquantised float32 cache. e4m3 keeps 3 mantissa bits (a relative
  rounding error of at most 2**-4 per element), so with unit-variance keys and values the outputs may move by
  up to ``FP8_ATOL`` = 0.25 and by ``FP8_MEAN_ATOL`` = 0.04 on average.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from dovetail.attention.backend import AttentionRequirements  # noqa: E402
from dovetail.attention.reference import ReferenceAttentionImpl  # noqa: E402
from dovetail.attention.triton_backend import TritonAttentionImpl, TritonBackend  # noqa: E402
from test_triton_attention import TOLERANCE, _rotary_inputs, make_case, spec_for  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_ATOL = 0.25
FP8_MEAN_ATOL = 0.04


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an FP8 cache stores for ``x``: ``x / scale`` saturated to e4m3's range and rounded to e4m3."""
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8)


def through_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` as an FP8 cache gives it back, in ``x``'s dtype."""
    return (quantize(x, scale).float() * scale).to(x.dtype)


def fp8_cache(cache: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    return torch.stack([quantize(cache[0], k_scale), quantize(cache[1], v_scale)])


def dequantized(cache8: torch.Tensor, k_scale: float, v_scale: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.stack([cache8[0].float() * k_scale, cache8[1].float() * v_scale]).to(dtype)


class _Fused(TritonAttentionImpl):
    def _fuses_into_decode_launch(self, num_decodes, q):
        return num_decodes > 0


class _Unfused(TritonAttentionImpl):
    def _fuses_into_decode_launch(self, num_decodes, q):
        return False


def run_fp8(impl_cls, spec, case, k_scale, v_scale, rotary=None):
    """TRITON's output and cache on the FP8 cache of ``case``, the exact reference's and the float32 one's."""
    q, k, v, cache, batch = case
    cache8 = fp8_cache(cache.float(), k_scale, v_scale)
    impl = impl_cls(spec)
    impl.k_scale, impl.v_scale = k_scale, v_scale
    out = (impl.forward(q, k, v, cache8, batch) if rotary is None
           else impl.forward_rotary(q, k, v, cache8, batch, rotary))
    reference = ReferenceAttentionImpl(spec)
    exact_cache = dequantized(fp8_cache(cache.float(), k_scale, v_scale), k_scale, v_scale, q.dtype)
    if rotary is not None:  # the keys are quantised after their rotation, so the references rotate first
        q_rot, k_rot = rotary.apply(rotary.positions, q.flatten(1), k.flatten(1))
        q, k = q_rot.view(q.shape), k_rot.view(k.shape)
    exact = reference.forward(q, through_fp8(k, k_scale), through_fp8(v, v_scale), exact_cache, batch)
    float_out = reference.forward(q.float(), k.float(), v.float(), cache.float().clone(), batch)
    stored = torch.stack([quantize(k, k_scale).float() * k_scale, quantize(v, v_scale).float() * v_scale])
    return out, cache8, exact, stored, float_out


def check_fp8(case, spec, k_scale=1.0, v_scale=1.0, rotary=None, impls=(_Fused, _Unfused)):
    q, k, v, cache, batch = case
    for impl_cls in impls:
        out, cache8, exact, want, float_out = run_fp8(impl_cls, spec, case, k_scale, v_scale, rotary)
        assert cache8.dtype == FP8 and out.dtype == q.dtype and out.shape == q.shape
        # The written slots hold exactly what vLLM stores for the new keys and values.
        written = batch.slot_mapping.long()
        stored = dequantized(cache8, k_scale, v_scale, torch.float32).view(2, -1, *cache.shape[-2:])[:, written]
        torch.testing.assert_close(stored, want, rtol=0, atol=0)
        torch.testing.assert_close(out.float(), exact.float(), **TOLERANCE[q.dtype])
        diff = (out.float() - float_out).abs()
        assert diff.max().item() <= FP8_ATOL and diff.mean().item() <= FP8_MEAN_ATOL, \
            f"FP8 cache output off the float32 cache's by {diff.max().item():.3g} (mean {diff.mean().item():.3g})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_batch_with_own_keys_stored_in_the_launch_or_before(dtype):
    case = make_case([1, 1, 1], [1, 30, 17], num_heads=4, num_kv_heads=2, dtype=dtype, seed=40)
    check_fp8(case, spec_for(case))


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.05, 0.02), (3.0, 0.5)])
def test_mixed_batch_with_calibrated_scales(k_scale, v_scale):
    case = make_case([1, 1, 5, 3], [9, 20, 5, 11], num_heads=4, num_kv_heads=2, dtype=torch.float32, seed=41)
    check_fp8(case, spec_for(case), k_scale, v_scale)


def test_prefill_chunked_prefill_window_and_softcap():
    case = make_case([6, 4], [6, 13], num_heads=8, num_kv_heads=2, head_size=64, block_size=8,
                     dtype=torch.bfloat16, seed=42)
    check_fp8(case, spec_for(case, sliding_window=5, logit_softcap=20.0), 0.1, 0.1)


@pytest.mark.parametrize("split_launch", [True, False], ids=["split-decode-launch", "unsplit"])
def test_rotary_paths_quantise_the_rotated_keys(split_launch):
    """``forward_rotary``: the rotary kernel cannot write an FP8 cache (it has no scales), so the rows the decode
    launch does not take are rotated and written by the quantising write; the decode launch rotates and
    quantises its own."""
    case = make_case([1, 1, 4, 3], [1, 23, 7, 12], num_heads=4, num_kv_heads=2, dtype=torch.bfloat16, seed=43)
    rotary = _rotary_inputs(case, 32, torch.float32, seed=44)
    check_fp8(case, spec_for(case), 0.5, 0.25, rotary, impls=(_Fused if split_launch else _Unfused,))


def test_saturation_and_rounding_match_torch():
    """Keys beyond e4m3's range saturate at 448 * scale; every stored byte is torch's (``float8_e4m3fn``)."""
    from dovetail.triton.kv_cache_write import write_kv_cache

    gen = torch.Generator().manual_seed(45)
    k = (torch.randn(64, 2, 32, generator=gen) * torch.logspace(-4, 3, 64)[:, None, None]).to(DEVICE)
    v = torch.randn(64, 2, 32, generator=gen).to(DEVICE) * 5
    cache = torch.zeros(2, 16, 4, 2, 32, dtype=FP8, device=DEVICE)
    slots = torch.randperm(64, generator=gen).to(device=DEVICE, dtype=torch.int32)
    write_kv_cache(k, v, cache, slots, 0.5, 2.0)
    got = cache.view(2, -1, 2, 32)[:, slots.long()].float()
    assert torch.equal(got[0], quantize(k, 0.5).float()) and torch.equal(got[1], quantize(v, 2.0).float())
    assert got[0].abs().max().item() == 448.0  # the largest keys saturate


def test_fp8_is_declared_and_other_backends_refuse_it_with_a_reason():
    def requirements(backend, kv_cache_dtype, device_type="cuda", platform="cuda"):
        return AttentionRequirements(platform=platform, device_type=device_type, dtype=torch.bfloat16,
                                     kv_cache_dtype=kv_cache_dtype, block_size=16, head_size=128, num_heads=8,
                                     num_kv_heads=2)

    assert TritonBackend.validate(requirements(TritonBackend, "fp8")) == []
    assert TritonBackend.validate(requirements(TritonBackend, "fp8_e4m3")) == []
    assert TritonBackend.validate(requirements(TritonBackend, "fp8_e5m2")) == [
        "kv_cache_dtype 'fp8_e5m2' not supported by TRITON (supported: auto, fp8, fp8_e4m3)"]
    from dovetail.attention.reference import ReferenceBackend

    reasons = ReferenceBackend.validate(requirements(ReferenceBackend, "fp8", "cpu", "cpu"))
    assert any(r.startswith("kv_cache_dtype 'fp8' not supported by REFERENCE") for r in reasons)


PLUGIN_SOURCE = '''
import torch

from dovetail.attention.reference import ReferenceAttentionImpl, ReferenceBackend
from dovetail.attention.triton_backend import TritonBackend
from dovetail.hookspecs import hookimpl

DOVETAIL_PLUGIN_API = ">=1.0,<2"


class TritonOnCpu(TritonBackend):
    """TRITON, accepting CPU tensors (its kernels then run in triton's interpreter)."""

    name = "TRITON_ON_CPU"
    supported_device_types = None


class Fp8RoundedReference(ReferenceAttentionImpl):
    """REFERENCE on a float cache whose new keys and values are first rounded as an FP8 cache stores them."""

    def forward(self, q, k, v, kv_cache, metadata):
        def through_fp8(x, scale):
            return ((x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)

        return super().forward(q, through_fp8(k, self.k_scale), through_fp8(v, self.v_scale), kv_cache, metadata)


class ReferenceFp8Rounded(ReferenceBackend):
    name = "REFERENCE_FP8_ROUNDED"

    @classmethod
    def impl_cls(cls):
        return Fp8RoundedReference


@hookimpl
def register_attention_backends(register):
    register(name="TRITON_ON_CPU", cls="triton_on_cpu:TritonOnCpu", platforms=("cpu",))
    register(name="REFERENCE_FP8_ROUNDED", cls="triton_on_cpu:ReferenceFp8Rounded", platforms=("cpu",))
'''


#: Calibrated KV-cache scales the checkpoint below carries, under vLLM's names.
CHECKPOINT_SCALES = {"model.layers.0.self_attn.k_scale": 0.5, "model.layers.0.self_attn.v_scale": 0.25,
                     "model.layers.1.self_attn.kv_scale": 2.0}


@pytest.fixture(scope="module")
def head32_llama_dir(tmp_path_factory):
    """A 2-layer GQA Llama whose head size (32) TRITON takes, with calibrated KV-cache scales."""
    from safetensors.torch import load_file, save_file

    import tiny_models

    config = tiny_models.tiny_llama_config(num_attention_heads=2, num_key_value_heads=1)
    path = tiny_models.save_model(tmp_path_factory.mktemp("llama-h32"), config)
    weights = load_file(str(path / "model.safetensors"))
    weights.update({name: torch.tensor(value) for name, value in CHECKPOINT_SCALES.items()})
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU: tests/test_cuda_engine.py::test_fp8_kv_cache_follows_bf16")
def test_engine_greedy_with_an_fp8_cache(head32_llama_dir, tmp_path, monkeypatch):
    """The whole engine, TRITON's kernels in the interpreter, ``kv_cache_dtype="fp8"`` with the checkpoint's
    scales (chunked prefills, decodes that store their own keys, rotary): greedy tokens and logprobs equal
    REFERENCE's on a float32 cache whose keys and values are rounded as the FP8 cache stores them; against a plain
    float32 cache (REFERENCE's), where the tokens first differ ours is among its 3 likeliest (vLLM's check for an
    FP8 cache), and logprobs agree to 0.1 until then."""
    from dovetail import LLM, SamplingParams
    from dovetail.plugin_manager import reset_plugin_manager
    from fake_plugins import install_fake_plugin

    install_fake_plugin(tmp_path / "plugin", monkeypatch, "triton_on_cpu", "triton_on_cpu", PLUGIN_SOURCE)
    reset_plugin_manager()
    prompts = [{"prompt_token_ids": p} for p in (list(range(20, 45)), [5, 6, 7], list(range(100, 111)))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    common = dict(device="cpu", block_size=16, max_num_batched_tokens=16)

    def generate(**kwargs):
        llm = LLM(str(head32_llama_dir), **common, **kwargs)
        return llm, llm.generate(prompts, params, use_tqdm=False)

    llm, got = generate(attention_backend="TRITON_ON_CPU", kv_cache_dtype="fp8")
    layers = llm.llm_engine.runner.attention_layers
    assert all(layer.kv_cache.dtype == FP8 for layer in layers)
    assert [(layer.impl.k_scale, layer.impl.v_scale) for layer in layers] == [(0.5, 0.25), (2.0, 2.0)]
    _, rounded = generate(attention_backend="REFERENCE_FP8_ROUNDED")
    for ours, ref in zip(got, rounded):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
        for step, token in enumerate(ref.outputs[0].token_ids):
            assert abs(ours.outputs[0].logprobs[step][token].logprob
                       - ref.outputs[0].logprobs[step][token].logprob) < 1e-3
    _, float_cache = generate(attention_backend="REFERENCE")
    for ours, ref in zip(got, float_cache):
        for step, (token, ref_token) in enumerate(zip(ours.outputs[0].token_ids, ref.outputs[0].token_ids)):
            if token != ref_token:
                assert token in ref.outputs[0].logprobs[step], f"step {step}: {token} not in the float top 3"
                break
            assert abs(ours.outputs[0].logprobs[step][token].logprob
                       - ref.outputs[0].logprobs[step][token].logprob) < 0.1
