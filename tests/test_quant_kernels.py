"""The quantization kernels against float references of their dequantised weights.

Each kernel is checked twice: against ``x @ W_deq.T`` computed here with the
activations quantized the same way (the kernel's own definition; bound
``EXACT``: float32 rounding only), and against plain float activations (the
quantization error itself; bounds per format below). Inputs are random, never
zeros; weight scales vary by orders of magnitude across rows.
"""

from __future__ import annotations

import pytest
import torch

from dovetail.quantization import quant_ops
from dovetail.quantization.fp8_scaled_mm import ScaledMMQuantKernels, fp8_linear_scaled_mm
from dovetail.quantization.kernels import QuantKernels, int8_matmul

FP8 = torch.float8_e4m3fn
EXACT = 2e-5
#: Relative to max |output|, against float activations and weights: FP8 keeps 3 mantissa bits
#: (rounding up to 6.25% per value; 1.8-5.8% measured on these K <= 96 products), INT8 rounds to
#: 1/254 of each row's range (0.5% measured).
VS_FLOAT = {"fp8": 0.1, "int8": 0.015}
OUT_DTYPE_TOL = {torch.float32: 0.0, torch.bfloat16: 1e-2, torch.float16: 2e-3}

KERNELS = QuantKernels()


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def weights(n=48, k=80, seed=0):
    gen = torch.Generator().manual_seed(seed)
    row_scale = torch.logspace(-2, 1, n)[torch.randperm(n, generator=gen)]
    return torch.randn(n, k, generator=gen) * row_scale[:, None]


def activations(m=7, k=80, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen) * torch.logspace(-1, 1, m)[:, None]


def fp8_tokenwise(x):
    s = x.abs().amax(1, keepdim=True) / 448
    return (x / s).clamp(-448, 448).to(FP8).float() * s


# -- FP8 ------------------------------------------------------------------------------------------


def test_fp8_per_channel_dynamic_matches_its_definition_and_float():
    w, x = weights(), activations()
    q, scale = quant_ops.quantize_fp8_per_channel(w)
    w_deq = q.float() * scale[:, None]
    assert rel(w_deq, w) < 0.07  # per-channel FP8 weights: under one half-ulp (6.25%) of each row's max
    out = KERNELS.fp8_linear(x, q, scale)
    assert rel(out, fp8_tokenwise(x) @ w_deq.t()) < EXACT
    assert rel(out, x @ w.t()) < VS_FLOAT["fp8"]


def test_fp8_static_activation_scale():
    w, x = weights(), activations()
    q, scale = quant_ops.quantize_fp8_per_channel(w)
    input_scale = torch.tensor(float(x.abs().max()) / 448)
    out = KERNELS.fp8_linear(x, q, scale, input_scale=input_scale)
    x_deq = (x / input_scale).clamp(-448, 448).to(FP8).float() * input_scale
    assert rel(out, x_deq @ (q.float() * scale[:, None]).t()) < EXACT


def test_fp8_block_scales_with_token_group_activations():
    n, k, bn, bk = 64, 96, 32, 32
    w, x = weights(n, k), activations(k=k)
    blocks = w.reshape(n // bn, bn, k // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)) / 448
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(FP8).reshape(n, k)
    w_deq = (q.float().reshape(n // bn, bn, k // bk, bk) * scale[:, None, :, None]).reshape(n, k)
    out = KERNELS.fp8_linear(x, q, scale, block_size=(bn, bk))
    groups = x.reshape(-1, k // bk, bk)
    gs = groups.abs().amax(-1, keepdim=True) / 448
    x_deq = ((groups / gs).clamp(-448, 448).to(FP8).float() * gs).reshape(-1, k)
    assert rel(out, x_deq @ w_deq.t()) < EXACT
    assert rel(out, x @ w.t()) < VS_FLOAT["fp8"]


def test_fp8_blocks_need_not_divide_the_weight():
    n, k, bn, bk = 40, 72, 32, 32  # ceil-sized scale grids, as transformers and DeepSeek write them
    w, x = weights(n, k), activations(k=k)
    scale = torch.rand(2, 3) + 0.5
    q = (w / 10).clamp(-448, 448).to(FP8)
    expanded = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    assert torch.equal(quant_ops.dequantize_fp8_weight(q, scale, (bn, bk)), q.float() * expanded)
    assert KERNELS.fp8_linear(x, q, scale, block_size=(bn, bk)).shape == (7, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_keeps_dtype_leading_dims_and_bias(dtype):
    w = weights()
    q, scale = quant_ops.quantize_fp8_per_channel(w)
    x = activations(m=6).reshape(2, 3, -1).to(dtype)
    bias = torch.randn(w.shape[0]).to(dtype)
    out = KERNELS.fp8_linear(x, q, scale, bias)
    assert out.dtype == dtype and out.shape == (2, 3, w.shape[0])
    expected = KERNELS.fp8_linear(x.reshape(6, -1).float(), q, scale) + bias.float()
    assert rel(out.reshape(6, -1), expected) <= OUT_DTYPE_TOL[dtype] + 1e-3 * (dtype != torch.float32)


def test_fp8_quantization_of_an_all_zero_row_stays_finite():
    w = weights()
    w[3] = 0
    q, scale = quant_ops.quantize_fp8_per_channel(w)
    out = KERNELS.fp8_linear(activations(), q, scale)
    assert torch.isfinite(out).all() and out[:, 3].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_path_matches_the_reference_kernel(dtype):
    # On a GPU where one is present (torch before 2.13 has no row-wise _scaled_mm on the CPU).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w, x = weights(64, 96).to(device), activations(k=96).to(device, dtype)
    q, scale = quant_ops.quantize_fp8_per_channel(w)
    ref = KERNELS.fp8_linear(x, q, scale)
    # the row-wise scaled_mm rounds its output to bfloat16
    assert rel(fp8_linear_scaled_mm(x, q, scale), ref) < 8e-3
    input_scale = torch.tensor(float(x.abs().max()) / 448, device=device)
    static = fp8_linear_scaled_mm(x, q, scale, input_scale=input_scale)
    assert rel(static, KERNELS.fp8_linear(x, q, scale, input_scale=input_scale)) < 8e-3


def test_scaled_mm_kernels_fall_back_where_scaled_mm_cannot_run():
    kernels = ScaledMMQuantKernels()
    w, x = weights(40, 72), activations(k=72)  # not multiples of 16
    q, scale = quant_ops.quantize_fp8_per_channel(w)
    assert torch.equal(kernels.fp8_linear(x, q, scale), KERNELS.fp8_linear(x, q, scale))


# -- INT8 ------------------------------------------------------------------------------------------


def int8_reference(x, q, scale, input_scale=None):
    if input_scale is None:
        sx = x.abs().amax(1, keepdim=True) / 127
    else:
        sx = input_scale
    xq = torch.round(x / sx).clamp(-127, 127)
    return (xq.double() @ q.double().t()).float() * sx * scale


def test_int8_dynamic_matches_its_definition_and_float():
    w, x = weights(), activations()
    q, scale = quant_ops.quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and rel(q.float() * scale[:, None], w) < 0.004
    out = KERNELS.int8_linear(x, q, scale)
    assert rel(out, int8_reference(x, q, scale)) < EXACT
    assert rel(out, x @ w.t()) < VS_FLOAT["int8"]


def test_int8_static_activation_scale():
    w, x = weights(), activations()
    q, scale = quant_ops.quantize_int8_per_channel(w)
    input_scale = torch.tensor(float(x.abs().max()) / 127)
    out = KERNELS.int8_linear(x, q, scale, input_scale=input_scale)
    assert rel(out, int8_reference(x, q, scale, input_scale)) < EXACT


def test_int8_matmul_is_exact_in_int32():
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (5, 2048), generator=gen, dtype=torch.int8)
    b = torch.randint(-127, 128, (24, 2048), generator=gen, dtype=torch.int8)
    out = int8_matmul(a, b)
    assert out.dtype == torch.int32
    assert torch.equal(out, (a.long() @ b.long().t()).int())


# -- packed 4/8-bit weights -------------------------------------------------------------------------


def test_pack_and_unpack_round_trip_and_awq_order():
    gen = torch.Generator().manual_seed(0)
    values = torch.randint(0, 16, (16, 24), generator=gen)
    packed = quant_ops.pack_int32(values, 4, dim=0)
    assert packed.shape == (2, 24) and packed.dtype == torch.int32
    assert torch.equal(quant_ops.unpack_int32(packed, 4, dim=0), values.int())
    # word c of a row holds columns 8c..8c+7 with field i holding column order[i] (AutoAWQ's GEMM layout)
    order = quant_ops.AWQ_PACK_ORDER
    words = torch.zeros(16, 3, dtype=torch.int64)
    for i, col in enumerate(order):
        words |= values[:, col::8] << (4 * i)
    words = torch.where(words >= 2**31, words - 2**32, words).int()
    assert torch.equal(quant_ops.unpack_int32(words, 4, dim=1, order=order), values.int())
    eight = torch.randint(0, 256, (8, 5), generator=gen)
    assert torch.equal(quant_ops.unpack_int32(quant_ops.pack_int32(eight, 8, 0), 8, 0), eight.int())


@pytest.mark.parametrize("bits", [4, 8])
def test_wna16_matches_the_dequantised_float_weight(bits):
    gen = torch.Generator().manual_seed(bits)
    k, n, groups = 64, 40, 4
    q = torch.randint(0, 2**bits, (k, n), generator=gen)
    scales = torch.rand(groups, n, generator=gen) * 0.1 + 1e-3
    zeros = torch.randint(0, 2**bits, (groups, n), generator=gen).float()
    g_idx = torch.randperm(k, generator=gen) % groups  # act-order: groups scattered over K
    w = (q.float() - zeros[g_idx]) * scales[g_idx]
    x = activations(k=k)
    out = KERNELS.wna16_linear(x, quant_ops.pack_int32(q, bits, 0), scales, zeros, g_idx.int(), bits)
    assert rel(out, x @ w) < EXACT


# -- the platform seam ------------------------------------------------------------------------------


def test_platform_kernels_reach_the_linear_layers(tiny_llama_dir, monkeypatch):
    from dovetail import LLM, SamplingParams
    from dovetail_cpu.platform import CpuPlatform

    calls = []

    class CountingKernels(QuantKernels):
        name = "counting"

        def fp8_linear(self, x, *args, **kwargs):
            calls.append(x.shape)
            return super().fp8_linear(x, *args, **kwargs)

    monkeypatch.setattr(CpuPlatform, "quant_kernels", lambda self: CountingKernels())
    llm = LLM(str(tiny_llama_dir), device="cpu", attention_backend="REFERENCE", quantization="fp8",
              kv_cache_memory_bytes=2**26)
    layer = llm.llm_engine.model.get_submodule("model.layers.0.mlp.down_proj")
    assert layer.quant_kernels.name == "counting"
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(calls) == 2 * 4 * 2  # 2 steps x 4 linear layers x 2 decoder layers


# -- on a GPU ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 33])
def test_scaled_mm_on_cuda_matches_the_reference(m):
    w, x = weights(256, 512), activations(m=m, k=512)
    q, scale = quant_ops.quantize_fp8_per_channel(w)
    ref = KERNELS.fp8_linear(x.bfloat16(), q, scale)
    out = fp8_linear_scaled_mm(x.cuda().bfloat16(), q.cuda(), scale.cuda())
    assert rel(out.cpu(), ref) < 8e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 17, 40])
def test_int8_on_cuda_matches_the_cpu(m):
    w, x = weights(256, 512), activations(m=m, k=512)
    q, scale = quant_ops.quantize_int8_per_channel(w)
    ref = KERNELS.int8_linear(x, q, scale)
    out = KERNELS.int8_linear(x.cuda(), q.cuda(), scale.cuda())
    assert rel(out.cpu(), ref) < 1e-5
