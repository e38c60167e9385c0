"""TritonFusedOps against the torch definitions of :mod:`dovetail.ops`, on random inputs.

Without a GPU the kernels run in triton's CPU interpreter (``TRITON_INTERPRET=1``
is set when this module is collected, before triton is first imported); with a
GPU the same tests run the compiled kernels on it. The interpreter rounds float32
to bfloat16 by truncation, the GPU to nearest: the bfloat16 tolerance covers both.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from dovetail import testing  # noqa: E402
from dovetail.layers.rotary import compute_cos_sin_cache  # noqa: E402
from dovetail.ops import FusedOps  # noqa: E402
from dovetail.triton.fused_ops import TritonFusedOps  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
TORCH, TRITON = FusedOps(), TritonFusedOps()


@pytest.fixture(scope="module", autouse=True)
def kernels_can_run_here():
    from dovetail.triton import interpreter_active

    if DEVICE == "cpu" and not interpreter_active():
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run on "
                    "the CPU in this process; something collected earlier imports triton at import time")


def rand(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def assert_close(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[expected.dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_fp32", [False, True])
def test_rms_norm(dtype, weight_fp32):
    x = rand(2, 3, 96, dtype=dtype, seed=1) * 3
    weight = rand(96, dtype=torch.float32 if weight_fp32 else dtype, seed=2)
    assert_close(TRITON.rms_norm(x, weight, 1e-6), TORCH.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_returns_normed_sum_and_sum(dtype):
    x, residual = rand(5, 100, dtype=dtype, seed=3), rand(5, 100, dtype=dtype, seed=4)
    weight = rand(100, dtype=dtype, seed=5)
    residual_before = residual.clone()
    normed, summed = TRITON.add_rms_norm(x, residual, weight, 1e-5)
    expected_normed, expected_summed = TORCH.add_rms_norm(x, residual, weight, 1e-5)
    assert_close(summed, expected_summed)
    assert_close(normed, expected_normed)
    assert torch.equal(residual, residual_before)


def test_rms_norm_of_a_strided_view():
    wide = rand(4, 160, seed=6)
    x = wide[:, :64]
    weight = rand(64, seed=7)
    assert_close(TRITON.rms_norm(x, weight, 1e-6), TORCH.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("weight_fp32", [False, True])
def test_rms_norm_of_heads_read_in_place_from_a_fused_qkv(weight_fp32):
    """Per-head q/k norms on [tokens, heads, head] views of a QKV output (Qwen3, Gemma3): no copy first."""
    qkv = rand(5, 3 * 32 + 2 * 32, seed=8)  # 3 query heads and 2 KV heads of 32, strided token rows
    q, k = qkv[:, :96].unflatten(-1, (3, 32)), qkv[:, 96:128].unflatten(-1, (1, 32))
    weight = rand(32, seed=9).float() if weight_fp32 else rand(32, seed=9)
    for view in (q, k):
        out = TRITON.rms_norm(view, weight, 1e-6)
        assert out.shape == view.shape and out.is_contiguous()
        assert_close(out, TORCH.rms_norm(view, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = rand(3, 2, 2 * 72, dtype=dtype, seed=8) * 4
    assert_close(TRITON.silu_and_mul(x), TORCH.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul(dtype):
    x = rand(4, 2 * 40, dtype=dtype, seed=9) * 4
    assert_close(TRITON.gelu_tanh_and_mul(x), TORCH.gelu_tanh_and_mul(x))


def test_silu_and_mul_wider_than_one_program():
    x = rand(2, 2 * 1500, seed=10)
    assert_close(TRITON.silu_and_mul(x), TORCH.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,rotary_dim", [(32, 32), (48, 24)])
def test_rotary_on_views_of_a_fused_qkv(dtype, head_size, rotary_dim):
    num_heads, num_kv_heads, tokens = 4, 2, 6
    params = {"rope_theta": 10000.0, "rope_type": "default"}
    cos_sin = compute_cos_sin_cache(rotary_dim, 128, params, 128).to(DEVICE)
    qkv = rand(tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype, seed=11)
    q = qkv[:, : num_heads * head_size]
    k = qkv[:, num_heads * head_size: (num_heads + num_kv_heads) * head_size]
    positions = torch.tensor([0, 1, 2, 17, 64, 127], device=DEVICE)
    qkv_before = qkv.clone()
    q_out, k_out = TRITON.rotary_embedding(positions, q, k, cos_sin, head_size, rotary_dim)
    q_ref, k_ref = TORCH.rotary_embedding(positions, q, k, cos_sin, head_size, rotary_dim)
    assert_close(q_out, q_ref)
    assert_close(k_out, k_ref)
    assert torch.equal(qkv, qkv_before)
    assert not torch.allclose(q_out.float(), q.float(), atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_fp32", [False, True])
def test_qk_norm_and_rotary_in_one_launch_on_views_of_a_fused_qkv(dtype, weight_fp32):
    """Qwen 3's per-head q/k RMSNorm (weights of the activations' dtype) and Gemma 3's (float32, 1 + w) before
    the rotary, in the rotary kernel: the torch definition (norms, then rotary) within rounding."""
    head_size, num_heads, num_kv_heads, tokens = 32, 4, 2, 6
    cos_sin = compute_cos_sin_cache(head_size, 128, {"rope_theta": 10000.0, "rope_type": "default"}, 128).to(DEVICE)
    qkv = rand(tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype, seed=13) * 3
    q = qkv[:, : num_heads * head_size]
    k = qkv[:, num_heads * head_size: (num_heads + num_kv_heads) * head_size]
    weight_dtype = torch.float32 if weight_fp32 else dtype
    q_w, k_w = rand(head_size, dtype=weight_dtype, seed=14) + 1, rand(head_size, dtype=weight_dtype, seed=15) + 1
    positions = torch.tensor([0, 1, 2, 17, 64, 127], device=DEVICE)
    got = TRITON.qk_norm_rotary_embedding(positions, q, k, q_w, k_w, 1e-6, cos_sin, head_size, head_size)
    want = TORCH.qk_norm_rotary_embedding(positions, q, k, q_w, k_w, 1e-6, cos_sin, head_size, head_size)
    for g, w in zip(got, want):
        assert_close(g, w)
    rotary_only = TORCH.rotary_embedding(positions, q, k, cos_sin, head_size, head_size)
    assert not torch.allclose(got[0].float(), rotary_only[0].float(), atol=1e-2)  # the norm was applied


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [False, True])
def test_rotary_into_the_kv_cache_equals_rotary_then_cache_write(dtype, norm):
    """One launch rotates q (returned) and stores the rotated k and v at each token's slot: the same q and
    the same cache as the rotary kernel followed by the cache write. A negative slot stores nothing."""
    from dovetail.triton import kv_cache_write, rotary

    head_size, num_heads, num_kv_heads, tokens, block_size = 32, 4, 2, 6, 4
    cos_sin = compute_cos_sin_cache(head_size, 128, {"rope_theta": 10000.0, "rope_type": "default"}, 128).to(DEVICE)
    qkv = rand(tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype, seed=21) * 3
    q = qkv[:, : num_heads * head_size]
    k = qkv[:, num_heads * head_size: (num_heads + num_kv_heads) * head_size]
    v = qkv[:, (num_heads + num_kv_heads) * head_size:]
    weights = (rand(head_size, dtype=dtype, seed=22) + 1, rand(head_size, dtype=dtype, seed=23) + 1) if norm \
        else (None, None)
    positions = torch.tensor([0, 1, 2, 17, 64, 127], device=DEVICE)
    slots = torch.tensor([5, 0, -1, 13, 2, 9], device=DEVICE)
    cache = rand(2, 5, block_size, num_kv_heads, head_size, dtype=dtype, seed=24)
    expected_cache = cache.clone()
    q_want, k_want = rotary.rotary_embedding(positions, q, k, cos_sin, head_size, head_size, *weights, 1e-6)
    kv_cache_write.write_kv_cache(k_want.view(tokens, num_kv_heads, head_size), v.view(tokens, num_kv_heads, head_size),
                                  expected_cache, slots)
    assert rotary.writes_cache(k, v, cache[0], cache[1], head_size, head_size)
    q_got = rotary.rotary_embedding_into_cache(positions, q, k, v, cache[0], cache[1], slots, cos_sin, head_size,
                                               *weights, 1e-6)
    assert torch.equal(q_got, q_want)
    assert torch.equal(cache, expected_cache)
    assert not rotary.writes_cache(k, v, cache[0], cache[1], head_size, head_size // 2)  # partial rotary


def test_qk_norm_with_partial_rotary_uses_the_torch_definition():
    head_size, rotary_dim = 32, 16
    cos_sin = compute_cos_sin_cache(rotary_dim, 64, {"rope_theta": 10000.0, "rope_type": "default"}, 64).to(DEVICE)
    q, k = rand(3, 2 * head_size, seed=16), rand(3, head_size, seed=17)
    q_w, k_w = rand(head_size, seed=18), rand(head_size, seed=19)
    positions = torch.tensor([3, 9, 40], device=DEVICE)
    got = TRITON.qk_norm_rotary_embedding(positions, q, k, q_w, k_w, 1e-6, cos_sin, head_size, rotary_dim)
    want = TORCH.qk_norm_rotary_embedding(positions, q, k, q_w, k_w, 1e-6, cos_sin, head_size, rotary_dim)
    for g, w in zip(got, want):
        assert_close(g, w)


def test_empty_inputs_use_the_torch_definition():
    x = rand(0, 16)
    weight = rand(16, seed=12)
    assert TRITON.rms_norm(x, weight, 1e-6).shape == (0, 16)
    assert TRITON.silu_and_mul(rand(0, 32)).shape == (0, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conformance_kit(dtype):
    testing.check_fused_ops(TRITON, DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(1, 50), (3, 9000), (2, 128256)])
def test_argmax_finds_the_first_maximum_of_each_row(dtype, rows, vocab):
    """The Triton argmax (what TritonFusedOps.argmax runs on a GPU) against torch's, with planted ties: within one
    chunk of the first launch, across chunks, and a row whose maximum sits in its last, partial chunk."""
    from dovetail.triton import argmax

    logits = rand(rows, vocab, dtype=dtype, seed=rows)
    top = logits.float().max() + 4
    logits[0, vocab // 3] = logits[0, 2 * vocab // 3] = top
    if rows > 1:
        logits[1, vocab - 1] = top
        logits[1, 7] = logits[1, 9] = top - 1
    if rows > 2:
        logits[2, 11] = logits[2, 12] = top
    got = argmax.argmax(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got.cpu(), logits.argmax(dim=-1).cpu())
    assert int(got[0]) == vocab // 3


def test_argmax_leaves_other_inputs_to_torch():
    from dovetail.triton import argmax

    assert not argmax.supports(rand(65, 100)) and not argmax.supports(rand(2, 100).t())
    assert torch.equal(TRITON.argmax(rand(65, 100)), rand(65, 100).argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_sizes,slots,rank,tokens", [([64], 1, 16, 5), ([128, 64, 64], 4, 16, 37),
                                                         ([64, 64], 3, 8, 16)])
def test_lora_expand_matches_torch(out_sizes, slots, rank, tokens, dtype):
    """LoRA's expand step: each token's own slot (or none) of every merged part, added into the output."""
    gen = torch.Generator().manual_seed(tokens)
    shrunk = rand(tokens, len(out_sizes) * slots * rank, dtype=dtype, seed=1)
    token_slots = torch.randint(-1, slots, (tokens,), generator=gen)
    mask = torch.nn.functional.one_hot(token_slots + 1, slots + 1)[:, 1:].to(device=DEVICE, dtype=dtype)
    b = rand(slots * rank, sum(out_sizes), dtype=dtype, seed=2)
    out = rand(tokens, sum(out_sizes), dtype=dtype, seed=3)
    expected = TORCH.lora_expand(shrunk, mask, b, out.clone(), out_sizes, rank)
    got = TRITON.lora_expand(shrunk, mask, b, out.clone(), out_sizes, rank)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    assert not torch.equal(expected, out), "some rows take an update"
