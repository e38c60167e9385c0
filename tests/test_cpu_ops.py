"""The CPU platform's fused ops (C++ SIMD) against their torch definitions, on every ISA path this CPU runs."""

from __future__ import annotations

import pytest
import torch

from dovetail import testing
from dovetail.errors import ConfigError
from dovetail.ops import FusedOps
from dovetail_cpu import isa
from dovetail_cpu.ops import CpuFusedOps

DTYPES = (torch.float32, torch.bfloat16)
TORCH = FusedOps()
OPS = CpuFusedOps()


@pytest.fixture(params=isa.ISA_NAMES)
def isa_path(request):
    name = request.param
    if name not in isa.supported_isas():
        pytest.skip(f"this CPU (or build) lacks the {name} path; it runs: {', '.join(isa.supported_isas())}")
    before = isa.selected_isa()
    isa.select_isa(name)
    yield name
    isa.select_isa(before)


def rand(*shape, dtype=torch.float32, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


def close(got, want, dtype):
    # bfloat16: one rounding step apart at most; float32: reduction order and exp's last bit.
    tol = dict(rtol=2e-6, atol=2e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 512), (3, 1000), (300, 512)])
def test_rms_norm_and_residual_add(isa_path, dtype, rows, hidden):
    x, residual = rand(rows, hidden, dtype=dtype, seed=1), rand(rows, hidden, dtype=dtype, seed=2)
    for weight in (rand(hidden, dtype=dtype, seed=3), rand(hidden, seed=3)):  # model dtype, or float32 (Gemma)
        close(OPS.rms_norm(x, weight, 1e-6), TORCH.rms_norm(x, weight, 1e-6), dtype)
        got, got_sum = OPS.add_rms_norm(x, residual, weight, 1e-5)
        want, want_sum = TORCH.add_rms_norm(x, residual, weight, 1e-5)
        assert torch.equal(got_sum, want_sum)
        close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,d", [(1, 1376), (5, 40), (2, 1000), (64, 1376)])
def test_silu_and_mul(isa_path, dtype, rows, d):
    x = rand(rows, 2 * d, dtype=dtype, seed=4) * 4  # reaches exp's saturated tails
    close(OPS.silu_and_mul(x), TORCH.silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_size,rotary_dim", [(64, 64), (80, 80), (128, 64), (256, 256)])
def test_rotary_embedding_is_exact(isa_path, dtype, head_size, rotary_dim):
    tokens, heads, kv_heads, max_pos = 11, 4, 2, 100
    qkv = rand(tokens, (heads + 2 * kv_heads) * head_size, dtype=dtype, seed=5)
    q, k, _ = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=-1)  # strided rows
    positions = torch.randint(0, max_pos, (tokens,), generator=torch.Generator().manual_seed(6))
    freqs = torch.rand(max_pos, rotary_dim // 2, generator=torch.Generator().manual_seed(7)) * 6.28
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    got_q, got_k = OPS.rotary_embedding(positions, q, k, cache, head_size, rotary_dim)
    want_q, want_k = TORCH.rotary_embedding(positions, q, k, cache, head_size, rotary_dim)
    # Same products and sums, each rounded to the dtype as torch rounds them: bit for bit.
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conformance_kit(isa_path, dtype):
    testing.check_fused_ops(OPS, "cpu", dtype)


def test_other_dtypes_fall_back_to_torch():
    x = rand(3, 64, dtype=torch.float16)
    w = rand(64, dtype=torch.float16)
    assert torch.equal(OPS.rms_norm(x, w, 1e-6), TORCH.rms_norm(x, w, 1e-6))
    assert torch.equal(OPS.silu_and_mul(x), TORCH.silu_and_mul(x))


def test_out_of_range_position_is_an_error():
    q, k = rand(2, 64), rand(2, 64)
    cache = torch.zeros(10, 64)
    with pytest.raises(ConfigError, match="positions"):
        OPS.rotary_embedding(torch.tensor([3, 10]), q, k, cache, 64, 64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n,k", [(1, 300, 512), (3, 64, 100), (4, 130, 256), (7, 48, 64), (2, 20000, 64),
                                        (37, 130, 256), (9, 66, 96)])
def test_small_batch_linear(isa_path, dtype, rows, n, k):
    from dovetail_cpu import kernels

    x, w, b = rand(rows, k, dtype=dtype, seed=8), rand(n, k, dtype=dtype, seed=9), rand(n, dtype=dtype, seed=10)
    want = torch.nn.functional.linear(x.float(), w.float(), b.float())
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=0.1)
    torch.testing.assert_close(kernels.linear(x, w, b, 2).float(), want, **tol)
    torch.testing.assert_close(OPS.linear(x, w, None).float(), want - b.float(), **tol)
    if dtype == torch.bfloat16:  # a float32 weight under bfloat16 activations
        torch.testing.assert_close(kernels.linear(x, w.float(), None, 2).float(), want - b.float(), **tol)
