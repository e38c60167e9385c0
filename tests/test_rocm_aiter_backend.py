"""ROCM_AITER's marshalling into aiter, checked on CPU against a FAKE aiter (real aiter never runs).

The fake (tests/test_rocm_fake_aiter.py) checks arguments as aiter does and
computes with aiter's semantics; the conformance kit compares the result with
REFERENCE. Only the device-type declaration is relaxed here (a CPU tensor
stands in for a HIP one); layouts, dtypes and metadata are the real ones.
"""

from __future__ import annotations

import pytest
import torch

from dovetail import testing
from dovetail.attention.backend import AttentionLayerSpec, AttentionRequirements
from dovetail.attention.batch import AttentionBatch
from dovetail.errors import PluginError
from dovetail_rocm.aiter_backend import RocmAiterBackend, gqa_ratio_supported
from test_rocm_fake_aiter import install_fake_aiter


class AiterOnCpu(RocmAiterBackend):
    """ROCM_AITER with CPU tensors accepted; everything else is the real backend."""

    supported_device_types = None


@pytest.fixture
def fake_aiter(monkeypatch):
    return install_fake_aiter(monkeypatch)


LONG_CASES = [
    # decodes of 301 and 521 tokens need several 256-token partitions in the workspace
    testing.AttentionCase("long-context-b32", ((300, 1), (520, 1), (0, 45), (270, 30)), 128, 8, 2, 32),
    testing.AttentionCase("gqa16-decode", ((70, 1), (33, 1), (5, 9)), 64, 16, 1, 16),
]
CASES = (testing.attention_cases(head_sizes=(64, 128), block_sizes=(16,))
         + [c for c in testing.attention_cases(head_sizes=(128,), block_sizes=(32,)) if c.name.endswith("b32")]
         + LONG_CASES)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_conformance_against_reference_through_fake_aiter(fake_aiter, case):
    try:
        testing.check_attention_case(AiterOnCpu, case, device="cpu", dtype=torch.bfloat16, platform="rocm")
    except testing.NotApplicable as exc:
        pytest.fail(f"ROCM_AITER should support {case}: {exc}")
    assert fake_aiter.calls, "the backend never called aiter"


def test_float16_mixed_batch(fake_aiter):
    case = testing.AttentionCase("fp16-mixed", ((30, 1), (9, 1), (0, 13), (17, 24)), 128, 8, 2, 16)
    testing.check_attention_case(AiterOnCpu, case, device="cpu", dtype=torch.float16, platform="rocm")


def _run(case_seqs, spec, block_size=16, dtype=torch.bfloat16, seed=0):
    """Run the backend once on a batch with decodes first; return (q, k, v, cache, batch, out)."""
    torch.manual_seed(seed)
    tables, next_block = [], 0
    for cached, new in case_seqs:
        need = -(-(cached + new) // block_size)
        tables.append(list(range(next_block + need - 1, next_block - 1, -1)))  # reversed: not contiguous
        next_block += need
    batch = AttentionBatch.from_lists([n for _, n in case_seqs], [c + n for c, n in case_seqs], tables, block_size)
    tokens = batch.num_tokens
    q = torch.randn(tokens, spec.num_heads, spec.head_size).to(dtype)
    k = torch.randn(tokens, spec.num_kv_heads, spec.head_size).to(dtype)
    v = torch.randn(tokens, spec.num_kv_heads, spec.head_size).to(dtype)
    cache = torch.randn(AiterOnCpu.kv_cache_shape(next_block, block_size, spec.num_kv_heads, spec.head_size)).to(dtype)
    builder = AiterOnCpu.metadata_builder_cls()(AiterOnCpu, [spec], block_size, torch.device("cpu"), dtype)
    out = AiterOnCpu.impl_cls()(spec).forward(q, k, v, cache, builder.build(batch))
    return q, k, v, cache, batch, out


def test_decode_call_passes_the_paged_cache_in_nhd_layout_without_copying(fake_aiter):
    spec = AttentionLayerSpec(8, 2, 64, 0.125)
    q, k, v, cache, batch, out = _run([(40, 1), (3, 1), (0, 20), (18, 6)], spec)
    names = [name for name, _ in fake_aiter.calls]
    assert names == ["paged_attention_v1", "flash_attn_varlen_func"]
    decode = fake_aiter.calls[0][1]
    assert decode["kv_cache_layout"] == "NHD"
    assert decode["key_cache"].data_ptr() == cache[0].data_ptr()
    assert decode["value_cache"].data_ptr() == cache[1].data_ptr()
    assert tuple(decode["key_cache"].shape) == tuple(cache.shape[1:])  # [blocks, block_size, kv_heads, head]
    assert decode["cu_query_lens"].tolist() == [0, 1, 2]
    assert decode["context_lens"].tolist() == [41, 4]
    assert decode["max_context_len"] == 41 and decode["partition_size"] == 256
    assert decode["sliding_window"] == 0 and decode["logits_soft_cap"] == 0.0
    assert decode["query"].shape[0] == 2 and decode["scale"] == 0.125


def test_chunked_prefill_gathers_the_whole_context_from_the_cache(fake_aiter):
    spec = AttentionLayerSpec(4, 4, 64, 0.125)
    q, k, v, cache, batch, out = _run([(0, 20), (18, 6)], spec)
    prefill = fake_aiter.calls[-1][1]
    assert prefill["cu_seqlens_q"].tolist() == [0, 20, 26]
    assert prefill["cu_seqlens_k"].tolist() == [0, 20, 44]
    assert (prefill["max_seqlen_q"], prefill["max_seqlen_k"], prefill["min_seqlen_q"]) == (20, 24, 6)
    assert prefill["causal"] is True and tuple(prefill["window_size"]) == (-1, -1)
    # the gathered keys of sequence 1 end with the 6 keys written this step
    assert torch.equal(prefill["k"][38:44], k[20:26])


def test_plain_prefill_passes_this_steps_keys_directly(fake_aiter):
    spec = AttentionLayerSpec(4, 2, 64, 0.125)
    q, k, v, cache, batch, out = _run([(0, 9), (0, 30)], spec)
    assert [name for name, _ in fake_aiter.calls] == ["flash_attn_varlen_func"]
    prefill = fake_aiter.calls[0][1]
    assert prefill["k"].data_ptr() == k.data_ptr() and prefill["v"].data_ptr() == v.data_ptr()
    assert prefill["cu_seqlens_k"].tolist() == prefill["cu_seqlens_q"].tolist() == [0, 9, 39]


def test_window_and_soft_cap_arguments(fake_aiter):
    windowed = AttentionLayerSpec(4, 2, 64, 0.125, sliding_window=8)
    _run([(45, 1), (20, 15)], windowed)
    decode, prefill = fake_aiter.calls[0][1], fake_aiter.calls[1][1]
    assert decode["sliding_window"] == 8
    assert tuple(prefill["window_size"]) == (7, 0)  # keys i-7..i: a window of 8
    fake_aiter.calls.clear()
    capped = AttentionLayerSpec(4, 2, 64, 0.125, logit_softcap=5.0)
    _run([(45, 1), (20, 15)], capped)
    assert fake_aiter.calls[0][1]["logits_soft_cap"] == 5.0 and fake_aiter.calls[1][1]["logits_soft_cap"] == 5.0


def _req(**overrides):
    base = dict(platform="rocm", device_type="cuda", dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16,
                head_size=128, num_heads=32, num_kv_heads=8)
    base.update(overrides)
    return AttentionRequirements(**base)


def test_validation_accepts_a_llama_shape(fake_aiter):
    assert RocmAiterBackend.validate(_req()) == []


@pytest.mark.parametrize("overrides, expected", [
    (dict(head_size=80), "head size 80 not supported by ROCM_AITER (supported: 64, 128, 256)"),
    (dict(dtype=torch.float32), "dtype float32 not supported by ROCM_AITER"),
    (dict(block_size=64), "block size 64 not supported by ROCM_AITER (supported: 16, 32)"),
    (dict(kv_cache_dtype="fp8_e4m3"), "kv_cache_dtype 'fp8_e4m3' not supported by ROCM_AITER"),
    (dict(num_heads=34, num_kv_heads=2), "17 query heads per KV head not supported by ROCM_AITER"),
    (dict(device_type="cpu"), "device type 'cpu' not supported by ROCM_AITER"),
    (dict(uses_sliding_window=True, uses_logit_softcap=True),
     "sliding-window attention combined with logit soft-capping not supported by ROCM_AITER"),
])
def test_validation_reasons(fake_aiter, overrides, expected):
    reasons = RocmAiterBackend.validate(_req(**overrides))
    assert any(expected in r for r in reasons), reasons


def test_gqa_ratios_the_decode_kernel_can_split():
    # ratios above 16 are split into ceil(ratio / 16) loops of ratio // loops heads, which must be exact
    assert all(gqa_ratio_supported(r, 1) for r in (1, 4, 8, 16, 18, 24, 32, 48, 64))
    assert not any(gqa_ratio_supported(r, 1) for r in (17, 31, 34, 50))


def test_sliding_window_needs_an_aiter_with_the_argument(monkeypatch):
    install_fake_aiter(monkeypatch, with_sliding_window=False)
    assert RocmAiterBackend.validate(_req()) == []
    reasons = RocmAiterBackend.validate(_req(uses_sliding_window=True))
    assert any("needs aiter >= 0.1.8" in r for r in reasons), reasons


def test_unavailable_without_aiter_or_when_switched_off(monkeypatch, fake_aiter):
    monkeypatch.setenv("DOVETAIL_ROCM_USE_AITER", "0")
    assert "switched off by DOVETAIL_ROCM_USE_AITER='0'" in RocmAiterBackend.available()
    monkeypatch.setenv("DOVETAIL_ROCM_USE_AITER", "1")
    assert RocmAiterBackend.available() is None
    monkeypatch.delitem(__import__("sys").modules, "aiter")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "aiter" else object())
    assert "aiter package is not installed" in RocmAiterBackend.available()


def test_triton_only_aiter_is_refused(monkeypatch, fake_aiter):
    monkeypatch.setenv("AITER_TRITON_ONLY", "1")
    assert "AITER_TRITON_ONLY=1" in RocmAiterBackend.available()
    monkeypatch.delenv("AITER_TRITON_ONLY")
    monkeypatch.delattr(type(fake_aiter), "flash_attn_varlen_func")
    with pytest.raises(PluginError, match="has no flash_attn_varlen_func"):
        RocmAiterBackend.impl_cls()(AttentionLayerSpec(4, 4, 64, 0.125))


def test_unavailable_on_a_torch_without_hip(monkeypatch, fake_aiter):
    monkeypatch.setattr(torch.version, "hip", None)
    assert "ROCm build of torch" in RocmAiterBackend.available()
