"""The weight-only FP8 GEMV (``dovetail.triton.gemv``) and its routing in ``GpuQuantKernels``.

Without a GPU the kernel runs in triton's CPU interpreter, switched on here before triton is first
imported (``TRITON_INTERPRET=1``); with a GPU the same tests run the compiled kernel. The reference is
``x.float() @ (w.float() * s[:, None]).T + bias`` on random inputs (never zeros); shapes are tiny and
ragged (N, K not multiples of the blocks), and explicit configs cover split-K and both multiply paths.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from dovetail.quantization import gpu_kernels, quant_ops  # noqa: E402
from dovetail.quantization.fp8_scaled_mm import fp8_linear_scaled_mm  # noqa: E402
from dovetail.quantization.gpu_kernels import GpuQuantKernels, use_fp8_gemv  # noqa: E402
from dovetail.triton import gemv as gemv_module  # noqa: E402
from dovetail.triton import next_power_of_2  # noqa: E402
from dovetail.ops import FusedOps  # noqa: E402
from dovetail.triton.gemv import INTERPRETED, GemvConfig, default_config, fp8_gemv, gemv, gemv_gated  # noqa: E402

FP8 = torch.float8_e4m3fn
#: Register sums (split over 3 slices of K), tensor-core dot (split in 2), several K steps each.
CONFIGS = {"default": None, "sum-split3": GemvConfig(16, 32, split_k=3),
           "dot-split2": GemvConfig(16, 16, split_k=2, dot=True)}


@pytest.fixture(scope="module", autouse=True)
def kernels_can_run_here():
    if DEVICE == "cpu" and not INTERPRETED:
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run on the CPU "
                    "in this process; something collected earlier imports triton at import time")


def case(m, n, k, dtype=torch.float32, seed=0):
    """x [m, k], FP8 weight [n, k] with row scales over three decades, its scales, a bias."""
    gen = torch.Generator().manual_seed(seed)
    row_scale = torch.logspace(-2, 1, n)[torch.randperm(n, generator=gen)]
    q, scale = quant_ops.quantize_fp8_per_channel(torch.randn(n, k, generator=gen) * row_scale[:, None])
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    return x, q, scale, bias


def reference(x, q, scale, bias=None):
    out = x.float() @ (q.float() * scale.reshape(-1, 1)).t()
    return out if bias is None else out + bias.float()


def assert_close(out, ref, dtype):
    """float32: within 1e-5 of max |ref|; 16-bit: the reference rounded to ``dtype``, within one ulp."""
    assert out.dtype == dtype and out.shape == ref.shape
    err = (out.cpu().float() - ref).abs()
    bound = 1e-5 * ref.abs().max()
    if dtype != torch.float32:
        bound = bound + torch.finfo(dtype).eps * ref.abs()
    assert bool((err <= bound).all()), f"max error {float(err.max()):.3g}, {float((err / bound).max()):.3g}x the bound"


def on(*tensors):
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_fp8_gemv_matches_the_float_reference(m, dtype, config):
    x, q, scale, bias = case(m, 40, 72, dtype, seed=m)
    out = fp8_gemv(*on(x, q, scale, bias), config=CONFIGS[config])
    assert_close(out, reference(x, q, scale, bias), dtype)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5])
def test_16_bit_weights_match_f_linear(m, dtype, config):
    """The same kernel on an unquantized weight of x's dtype (no scale): F.linear's result within rounding."""
    gen = torch.Generator().manual_seed(m)
    x, w, bias = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((m, 72), (40, 72), (40,)))
    out = gemv(*on(x, w, bias), config=CONFIGS[config])
    assert_close(out, x.float() @ w.float().t() + bias.float(), dtype)
    assert_close(gemv(*on(x, w)), x.float() @ w.float().t(), dtype)
    with pytest.raises(ValueError, match="x's dtype"):
        gemv(*on(x, w.to(torch.float64)))


#: Gated launches: register sums over 8 weight rows (4 outputs) split over 3 slices of K; the dot over 32 weight
#: rows (16 outputs) split in 2; the dot over blocks of 32 rows of x, unsplit.
GATED_CONFIGS = {"default": None, "sum-split3": GemvConfig(8, 32, split_k=3),
                 "dot-split2": GemvConfig(32, 16, split_k=2, dot=True),
                 "dot-rows32": GemvConfig(32, 32, dot=True, block_m=32)}


#: (rows, activation, dtype, launch): each launch in both dtypes and both activations, at one row (the register sums
#: of batch-1 decode), at a few (the dot over 16 rows) and past 16 (blocks of 32 rows, two blocks of 16 sums).
GATED_CASES = [(1, "silu", torch.bfloat16, "default"), (1, "gelu_tanh", torch.float32, "sum-split3"),
               (3, "silu", torch.float32, "dot-split2"), (5, "gelu_tanh", torch.bfloat16, "dot-split2"),
               (5, "silu", torch.float32, "default"), (21, "silu", torch.bfloat16, "dot-rows32"),
               (21, "gelu_tanh", torch.float32, "default"), (21, "silu", torch.bfloat16, "sum-split3")]


@pytest.mark.parametrize("m, activation, dtype, config", GATED_CASES, ids=str)
def test_gated_gemv_is_the_product_then_the_activation(m, activation, dtype, config):
    """``gemv_gated`` over a ragged [gate | up] weight (24 outputs, K 72) and a bias: the torch definition of the
    activation over the float product rounded to ``dtype``, within an ulp of each rounding on the way."""
    gen = torch.Generator().manual_seed(m)
    x, w, bias = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((m, 72), (48, 72), (48,)))
    product = (x.float() @ w.float().t() + bias.float()).to(dtype)
    act = FusedOps().silu_and_mul if activation == "silu" else FusedOps().gelu_tanh_and_mul
    out = gemv_gated(*on(x, w, bias), activation=activation, config=GATED_CONFIGS[config])
    assert out.shape == (m, 24)
    want = act(product).float()
    bound = 1e-5 * want.abs().max() + (0 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps) * (
        want.abs() + act(product.float()).abs())
    err = (out.cpu().float() - want).abs()
    assert out.dtype == dtype and bool((err <= bound).all()), f"max error {float(err.max()):.3g}"
    no_bias = gemv_gated(*on(x, w), activation=activation, config=GATED_CONFIGS[config]).cpu().float()
    assert (no_bias - act((x.float() @ w.float().t()).to(dtype)).float()).abs().max() <= bound.max()
    with pytest.raises(ValueError, match="gate | up"):
        gemv_gated(*on(x, w[:47]))
    with pytest.raises(ValueError, match="activation 'relu'"):
        gemv_gated(*on(x, w), activation="relu")


@pytest.mark.parametrize("m, block_m", [(20, 32), (40, 64), (40, 16)])
def test_dot_blocks_of_more_than_16_rows(m, block_m):
    """``block_m`` rows a program (one pass over the weight for up to ``block_m`` rows), unsplit and split over
    K: F.linear's result within rounding, the rows past ``m`` in the last block left out."""
    gen = torch.Generator().manual_seed(m + block_m)
    x, w = torch.randn(m, 72, generator=gen).bfloat16(), torch.randn(40, 72, generator=gen).bfloat16()
    for split_k in (1, 2):
        out = gemv(*on(x, w), config=GemvConfig(16, 16, split_k=split_k, dot=True, block_m=block_m))
        assert_close(out, x.float() @ w.float().t(), torch.bfloat16)


def test_gated_tiles_follow_the_rows_of_x_and_the_weight():
    """One row: register sums over the whole weight's tile; 2-16 rows: the dot over 16 rows, 64 weight rows a
    program where that makes three programs a multiprocessor, else 32; more: the plain tiles."""
    from dovetail.triton.gemv import gated_config

    assert gated_config(1, 14336, 4096) == default_config(1, 14336, 4096, 2)
    assert not gated_config(1, 14336, 4096).dot
    for m in (2, 8, 16):
        assert gated_config(m, 14336, 4096)[:6] == (32, 128, 4, 3, 1, True)  # llama-3.1-8b TP=2: 224 programs of 64
        assert gated_config(m, 25600, 5120).block_n == 64 and gated_config(m, 25600, 5120).block_m == 16
    assert gated_config(8, 25600, 5120, multiprocessors=160).block_n == 32
    assert gated_config(17, 14336, 4096) == default_config(17, 14336, 4096, 2)


def test_the_default_tiles_of_many_rows_take_blocks_of_rows():
    """Past 16 rows the default reads the weight once per block of up to 64 rows, not once per 16."""
    assert default_config(48, 5120, 2048, 2).block_m == 64
    assert default_config(256, 5120, 2048, 2).block_m == 64
    assert default_config(20, 5120, 2048, 2).block_m == 32
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(70, 256, generator=gen).bfloat16(), torch.randn(48, 256, generator=gen).bfloat16()
    assert_close(gemv(*on(x, w)), x.float() @ w.float().t(), torch.bfloat16)


def test_one_token_tiles_follow_the_weights_shape_and_the_devices_size():
    """16-bit weights at one token: a K step that divides K (unmasked loads), 8 weight rows a program while the
    launch fits one wave and has more programs than multiprocessors, else 4; so the device's size counts."""
    def tile(n, k, multiprocessors=132):
        cfg = default_config(1, n, k, 2, multiprocessors)
        assert not cfg.dot and cfg.split_k == 1
        return cfg.block_n, cfg.block_k

    assert tile(4096, 2048) == (8, 1024)  # llama-3.1-8b TP=2 o_proj: 512 programs, one wave
    assert tile(5120, 5120) == (4, 1024)  # qwen3-32b TP=2 qkv: 640 programs of 8 rows would spill past it
    assert tile(25600, 5120) == (4, 1024)
    assert tile(5120, 12800) == (8, 512)  # 12,800 is no multiple of 1,024; at 512 of K the wave is twice as wide
    assert tile(4096, 2048, multiprocessors=66) == (4, 1024)
    assert tile(1024, 3072) == (4, 1024)  # qwen3-0.6b down_proj: 128 programs of 8 rows leave multiprocessors idle
    assert tile(1024, 3072, multiprocessors=64) == (8, 1024)
    assert tile(40, 72, multiprocessors=4) == (8, 1024)  # no step of 256 or more divides 72: the plain step, masked
    assert default_config(2, 5120, 12800, 2).block_k == 512
    assert default_config(4, 5120, 12800, 2).block_k == 256


def test_every_finite_e4m3_value_converts_exactly():
    """All 254 finite bytes as weights (subnormals too), K = 1 and unit scales: each output is one product."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    w = codes[torch.isfinite(codes.float())].reshape(-1, 1)
    assert w.shape[0] == 254
    x = torch.randn(3, 1) + 3.0
    scale = torch.ones(254)
    want = x @ w.float().t()
    for config in (None, GemvConfig(16, 16, dot=True)):
        assert torch.equal(fp8_gemv(*on(x, w, scale), config=config).cpu(), want)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_tiles_that_divide_the_weight_read_without_masks(config):
    """N and K multiples of the tiles take the loop without K and N masks."""
    x, q, scale, bias = case(3, 64, 128, torch.bfloat16, seed=11)
    assert_close(fp8_gemv(*on(x, q, scale, bias), config=CONFIGS[config]), reference(x, q, scale, bias),
                 torch.bfloat16)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(12)).bfloat16()
    assert_close(gemv(*on(x, w), config=CONFIGS[config]), x.float() @ w.float().t(), torch.bfloat16)


def test_shapes_strides_and_scale_layouts():
    x, q, scale, bias = case(6, 24, 40, seed=3)
    ref = reference(x, q, scale, bias)
    wide = torch.randn(6, 56)
    wide[:, 8:48] = x  # rows 56 apart: the kernel reads x's row stride
    strided = wide[:, 8:48]
    for s in (scale, scale.reshape(-1, 1), scale.reshape(1, -1)):
        assert_close(fp8_gemv(*on(strided, q, s, bias)), ref, torch.float32)
    batched = fp8_gemv(*on(x.reshape(2, 3, 40), q, scale))
    assert batched.shape == (2, 3, 24)
    assert_close(batched.reshape(6, 24), reference(x, q, scale), torch.float32)
    assert fp8_gemv(*on(torch.randn(0, 40), q, scale)).shape == (0, 24)
    split = GemvConfig(16, 16, split_k=2, dot=True)
    first = fp8_gemv(*on(x, q, scale), config=split)
    assert all(int(c.count_nonzero()) == 0 for held in gemv_module._counters.values() for c in held)
    assert torch.equal(fp8_gemv(*on(x, q, scale), config=split), first)  # the reset counters serve the next call
    with pytest.raises(ValueError, match="N scales"):
        fp8_gemv(*on(x, q, scale[:5]))


def test_default_configs_are_valid_launches():
    """Powers of two, tensor-core tiles of at least 16, and split-K only while slices keep several K blocks."""
    shapes = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (40, 72))
    for m, (n, k), weight_bytes in itertools.product((1, 2, 3, 4, 8, 16, 48, 256), shapes, (1, 2)):
        cfg = default_config(m, n, k, weight_bytes)
        for v in (cfg.block_n, cfg.block_k, cfg.num_warps, cfg.split_k, cfg.block_m):
            assert v & (v - 1) == 0, cfg
        assert not cfg.dot or min(cfg.block_n, cfg.block_k, cfg.block_m) >= 16, cfg
        assert cfg.split_k == 1 or k >= 2 * cfg.block_k * cfg.split_k, cfg
        assert cfg.split_k == 1 or m <= 16 or cfg.split_k * m * n * 4 <= n * k * 2, \
            f"{cfg}: the partial sums of {m} rows outweigh the weight"
        assert cfg.dot or next_power_of_2(m) * cfg.block_n * cfg.block_k <= 8192, cfg  # register-sum accumulator


def test_gpu_kernels_route_few_tokens_to_the_gemv():
    """Up to FP8_GEMV_MAX_M tokens: the GEMV's very output (input_scale ignored); one more: torch._scaled_mm."""
    limit = gpu_kernels.FP8_GEMV_MAX_M
    kernels = GpuQuantKernels()
    x, q, scale, bias = on(*case(limit + 1, 48, 80, torch.bfloat16, seed=5))
    small = x[:limit].reshape(1, limit, 80)
    gemv = fp8_gemv(small, q, scale, bias)
    assert torch.equal(kernels.fp8_linear(small, q, scale, bias), gemv)
    static = torch.tensor(0.05, device=DEVICE)
    assert torch.equal(kernels.fp8_linear(small, q, scale, bias, input_scale=static), gemv)
    assert not torch.equal(fp8_linear_scaled_mm(small, q, scale, bias), gemv)  # so the check above tells them apart
    assert torch.equal(kernels.fp8_linear(x, q, scale, bias), fp8_linear_scaled_mm(x, q, scale, bias))
    assert use_fp8_gemv(1, q, scale, None) and use_fp8_gemv(limit, q, scale.reshape(-1, 1), None)
    assert not use_fp8_gemv(limit + 1, q, scale, None)
    assert not use_fp8_gemv(1, q, scale, (16, 16))
    assert not use_fp8_gemv(1, q.float(), scale, None)
    assert not use_fp8_gemv(1, q, scale[:1], None)


def test_gpu_kernels_import_no_triton_and_fall_back_without_it():
    code = (
        "import sys, torch\n"
        "from dovetail.quantization.gpu_kernels import GpuQuantKernels\n"
        "from dovetail.quantization.fp8_scaled_mm import fp8_linear_scaled_mm\n"
        "assert 'triton' not in sys.modules and 'dovetail.triton.gemv' not in sys.modules\n"
        "sys.modules['triton'] = None\n"
        f"q, s = torch.randn(32, 64).to(torch.float8_e4m3fn).to('{DEVICE}'), torch.rand(32, device='{DEVICE}') + 0.1\n"
        f"x = torch.randn(1, 64, device='{DEVICE}')\n"
        "assert torch.equal(GpuQuantKernels().fp8_linear(x, q, s), fp8_linear_scaled_mm(x, q, s))\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_fp8_gemv_on_cuda_at_llama_shapes_and_in_a_graph(m, n, k):
    x, q, scale, bias = case(m, n, k, torch.bfloat16, seed=m)
    ref = reference(x, q, scale, bias)
    x, q, scale, bias = (t.cuda() for t in (x, q, scale, bias))
    assert_close(fp8_gemv(x, q, scale, bias), ref, torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemv(x, q, scale, bias)
    x.copy_(x.flip(0))
    graph.replay()
    assert_close(out, ref.flip(0), torch.bfloat16)
    first = out.clone()
    for _ in range(20):  # split-K tiles finish in any order, and their sums must not depend on it
        graph.replay()
        assert torch.equal(out, first)
