"""The CUDA plugin's C++ FP8 GEMV (``dovetail_cuda.fp8_gemv``), its nvcc build and its routing.

Without a GPU: the source compiles for sm_90a and sm_89 with the nvcc of this machine (skipped where there is
none), the choice and config variables are validated, and CPU tensors never reach the kernel. With
one (sm_89+ and nvcc): every e4m3 byte, random ragged shapes against the float
reference and against the Triton GEMV, bias and float16, SiLU-and-mul fused (``gated``), CUDA graph
capture, routing in ``CudaQuantKernels``, and an FP8 engine's greedy tokens with it against the Triton GEMV.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("dovetail_cuda")

from dovetail.errors import ConfigError  # noqa: E402
from dovetail.quantization import quant_ops  # noqa: E402
from dovetail_cuda import native, quant_kernels  # noqa: E402
from dovetail_cuda.fp8_gemv import GATED_DEFAULT, SOURCE, NativeGemvConfig, fp8_gemv, supports  # noqa: E402

FP8 = torch.float8_e4m3fn
#: Every compiled row count, step count, trigger and split, each at least once, and blocks of 1 to 16 warps.
CONFIGS = [NativeGemvConfig(1, 1, 0), NativeGemvConfig(1, 2, 2, 8, 2), NativeGemvConfig(2, 2, 3, 16, 2),
           NativeGemvConfig(2, 1, 2), NativeGemvConfig(1, 2, 3, 1), NativeGemvConfig(2, 2, 0, 2, 2),
           NativeGemvConfig(1, 1, 3, 4, 2)]


def _gpu_ready() -> str | None:
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU"
    if torch.cuda.get_device_capability(0) < (8, 9):
        return "needs sm_89+ (FP8)"
    return native.unavailable_reason(SOURCE, 0)


gpu = pytest.mark.gpu


def needs_kernel():
    reason = _gpu_ready()
    if reason:
        pytest.skip(reason)


def test_source_compiles_and_exports_the_launcher_for_hopper_and_ada(tmp_path, monkeypatch):
    """The cuda platform routes FP8 to this kernel from sm_89 on; the build for each is checked here, both at once
    (nvcc takes tens of seconds an architecture on a small CPU)."""
    nvcc = native.nvcc_path()
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    monkeypatch.setenv("DOVETAIL_CACHE_DIR", str(tmp_path))
    capabilities = [(9, 0), (8, 9)]
    with ThreadPoolExecutor(len(capabilities)) as pool:
        builds = list(pool.map(lambda capability: native.build(SOURCE, capability, nvcc), capabilities))
    for capability, built in zip(capabilities, builds):
        assert built.parent == tmp_path / "cuda" and native.arch_flag(capability) in built.name
        assert native.build(SOURCE, capability, nvcc) == built  # cached: same key, no rebuild
        try:
            lib = ctypes.CDLL(str(built))
        except OSError as exc:  # the CUDA runtime library may be absent where only nvcc is installed
            pytest.skip(f"cannot load the library here: {exc}")
        assert hasattr(lib, "dovetail_fp8_gemv")


def test_arch_flags():
    assert native.arch_flag((9, 0)) == "sm_90a"
    assert native.arch_flag((8, 9)) == "sm_89"
    assert native.arch_flag((10, 0)) == "sm_100"


def test_choice_and_config_variables(monkeypatch):
    monkeypatch.delenv("DOVETAIL_CUDA_FP8_GEMV", raising=False)
    assert quant_kernels.fp8_gemv_choice() == "cuda"
    monkeypatch.setenv("DOVETAIL_CUDA_FP8_GEMV", "Triton")
    assert quant_kernels.fp8_gemv_choice() == "triton"
    monkeypatch.setenv("DOVETAIL_CUDA_FP8_GEMV", "cutlass")
    with pytest.raises(ConfigError, match="DOVETAIL_CUDA_FP8_GEMV='cutlass'"):
        quant_kernels.fp8_gemv_choice()
    monkeypatch.delenv("DOVETAIL_CUDA_FP8_GEMV_CONFIG", raising=False)
    assert quant_kernels.native_config() == NativeGemvConfig()
    monkeypatch.setenv("DOVETAIL_CUDA_FP8_GEMV_CONFIG", "rows=2, trigger=3")
    assert quant_kernels.native_config() == NativeGemvConfig()._replace(rows=2, trigger=3)
    assert quant_kernels.native_config(gated=True) == GATED_DEFAULT, "the gated GEMV has its own variable"
    monkeypatch.setenv("DOVETAIL_CUDA_FP8_GEMV_GATED_CONFIG", "warps=8,split=2")
    assert quant_kernels.native_config(gated=True) == GATED_DEFAULT._replace(warps=8, split=2)
    monkeypatch.setenv("DOVETAIL_CUDA_FP8_GEMV_GATED_CONFIG", "warps=1,split=2")
    with pytest.raises(ConfigError, match="GATED_CONFIG='warps=1,split=2': split \\(2\\) must divide"):
        quant_kernels.native_config(gated=True)
    for bad in ("rows=two", "lanes=3", "4,2,1", "trigger=1", "rows=4", "split=4", "warps=1,split=2"):
        monkeypatch.setenv("DOVETAIL_CUDA_FP8_GEMV_CONFIG", bad)
        with pytest.raises(ConfigError, match="DOVETAIL_CUDA_FP8_GEMV_CONFIG"):
            quant_kernels.native_config()


def test_default_config_shares_k_when_outputs_are_few_for_the_gpu(monkeypatch):
    from dovetail_cuda.fp8_gemv import SHARED_K_BELOW, SHARED_K_DEFAULT, SHARED_K_MIN_K, default_config

    h200 = 132
    assert default_config(False, 4096, h200, 4096) == SHARED_K_DEFAULT  # llama-3.1-8b's o projection
    assert default_config(False, 4096, h200, 14336) == SHARED_K_DEFAULT  # and its down projection
    assert default_config(False, SHARED_K_BELOW * h200, h200, 4096) == NativeGemvConfig()
    assert default_config(False, 6144, h200, 4096) == NativeGemvConfig()  # its qkv
    assert default_config(False, 1024, h200, 3072) == NativeGemvConfig()  # qwen3-0.6b's down: rows too short
    assert default_config(False, 1024, h200, SHARED_K_MIN_K) == SHARED_K_DEFAULT
    assert default_config(True, 1024, h200, 8192) == GATED_DEFAULT
    assert default_config(False) == NativeGemvConfig()
    assert SHARED_K_DEFAULT.warps % SHARED_K_DEFAULT.split == 0
    monkeypatch.setenv("DOVETAIL_CUDA_FP8_GEMV_CONFIG", "warps=16")
    assert quant_kernels.native_config(False, 4096, h200, 4096) == SHARED_K_DEFAULT._replace(warps=16)
    assert quant_kernels.native_config(False, 6144, h200, 4096) == NativeGemvConfig(warps=16)


def test_cpu_tensors_are_not_taken():
    q, scale = quant_ops.quantize_fp8_per_channel(torch.randn(32, 64))
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    assert not supports(x, q, scale, None)
    with pytest.raises(ValueError, match="unsupported operands"):
        fp8_gemv(x, q, scale)


def _case(n, k, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=gen) * torch.logspace(-2, 1, n, device="cuda")[:, None]
    q, scale = quant_ops.quantize_fp8_per_channel(w)
    x = torch.randn(1, k, device="cuda", generator=gen).to(dtype)
    bias = torch.randn(n, device="cuda", generator=gen).to(dtype)
    return x, q, scale, bias


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_e4m3_byte_is_exact(dtype):
    needs_kernel()
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8, device="cuda")
    weight = codes[:, None].expand(-1, 16).contiguous().view(FP8)
    out = fp8_gemv(torch.ones(1, 16, device="cuda", dtype=dtype), weight, torch.ones(len(codes), device="cuda"),
                   config=NativeGemvConfig(1, 1))
    torch.testing.assert_close(out.float()[0], 16 * weight[:, 0].float(), rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"r{c.rows}u{c.unroll}t{c.trigger}w{c.warps}s{c.split}")
@pytest.mark.parametrize("n,k", [(37, 16), (133, 528), (301, 4112)])
def test_matches_float_reference_and_triton(cfg, n, k):
    needs_kernel()
    from dovetail.triton.gemv import fp8_gemv as triton_fp8_gemv

    for dtype in (torch.bfloat16, torch.float16):
        x, q, scale, bias = _case(n, k, dtype)
        ref = x.float() @ (q.float() * scale[:, None]).t() + bias.float()
        out = fp8_gemv(x, q, scale, bias, config=cfg)
        assert out.dtype == dtype and out.shape == (1, n)
        # float32 sums in another order, then one rounding to x's dtype
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
        torch.testing.assert_close(out, triton_fp8_gemv(x, q, scale, bias), rtol=1e-2, atol=1e-2 * ref.abs().max().item())


@gpu
@pytest.mark.parametrize("cfg", CONFIGS[:3], ids=lambda c: f"r{c.rows}u{c.unroll}t{c.trigger}w{c.warps}s{c.split}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gated_applies_silu_and_mul_to_the_product(cfg, dtype):
    needs_kernel()
    x, q, scale, bias = _case(2 * 133, 528, dtype)
    y = x.float() @ (q.float() * scale[:, None]).t() + bias.float()
    ref = torch.nn.functional.silu(y[:, :133]) * y[:, 133:]
    out = fp8_gemv(x, q, scale, bias, config=cfg, gated=True)
    assert out.shape == (1, 133) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    assert not supports(x, q[:-1], scale[:-1], None, gated=True), "an odd row count has no halves"


@gpu
def test_strided_weight_rows_and_graph_replay():
    needs_kernel()
    x, q, scale, _ = _case(96, 256, torch.bfloat16)
    wide = torch.zeros(96, 512, device="cuda").to(FP8)
    wide[:, :256] = q
    view = wide[:, :256]  # row stride 512
    eager = fp8_gemv(x, view, scale)
    torch.testing.assert_close(eager, fp8_gemv(x, q, scale), rtol=0, atol=0)
    static_x = x.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8_gemv(static_x, q, scale)
    static_x.copy_(x * 2)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, fp8_gemv(x * 2, q, scale), rtol=0, atol=0)


@gpu
def test_quant_kernels_route_one_token_to_the_cuda_gemv(monkeypatch):
    needs_kernel()
    calls = []
    original = quant_kernels.native_gemv.launch
    monkeypatch.setattr(quant_kernels.native_gemv, "launch", lambda *a: calls.append(1) or original(*a))
    x, q, scale, bias = _case(64, 128, torch.bfloat16)
    kernels = quant_kernels.CudaQuantKernels()
    one = kernels.fp8_linear(x, q, scale, bias)
    assert calls == [1]
    kernels.fp8_linear(torch.cat([x, x]), q, scale, bias)  # two tokens: the Triton GEMV
    assert calls == [1]
    gated = kernels.fp8_linear_gated(x, q, scale, bias, "silu")
    assert calls == [1, 1] and gated.shape == (1, 32)
    assert kernels.fp8_linear_gated(x, q, scale, bias, "gelu_tanh") is None
    assert kernels.fp8_linear_gated(torch.cat([x, x]), q, scale, bias, "silu") is None
    from dovetail_cuda.fp8_gemv import SHARED_K_DEFAULT

    configs = []  # launch(lib, x, weight, scale, bias, config, ...): the config for each weight shape
    monkeypatch.setattr(quant_kernels.native_gemv, "launch", lambda *a: configs.append(a[5]) or original(*a))
    x_long, q_long, scale_long, _ = _case(64, 4096, torch.bfloat16)
    shared = kernels.fp8_linear(x_long, q_long, scale_long)
    kernels.fp8_linear(x, q, scale)
    assert configs == [SHARED_K_DEFAULT, NativeGemvConfig()], "few outputs with long rows share K"
    ref = x_long.float() @ (q_long.float() * scale_long[:, None]).t()
    torch.testing.assert_close(shared.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    monkeypatch.setattr(quant_kernels.native_gemv, "launch", lambda *a: calls.append(1) or original(*a))
    monkeypatch.setenv("DOVETAIL_CUDA_FP8_GEMV", "triton")
    triton_kernels = quant_kernels.CudaQuantKernels()
    torch.testing.assert_close(triton_kernels.fp8_linear(x, q, scale, bias), one, rtol=1e-2, atol=1e-2)
    assert triton_kernels.fp8_linear_gated(x, q, scale, bias, "silu") is None
    assert calls == [1, 1]


@gpu
def test_fp8_engine_greedy_tokens_match_the_triton_gemv(tmp_path, monkeypatch):
    """Batch-1 decode of a tiny Llama with --quantization fp8: the CUDA GEMV (and its fused SiLU) against the
    Triton GEMV and separate SiLU. Tokens may differ only where the Triton run's top two are within 0.05."""
    needs_kernel()
    import gc

    from dovetail import LLM, SamplingParams
    from tiny_models import save_model, tiny_llama_config

    model_dir = save_model(tmp_path / "tiny-llama", tiny_llama_config(
        hidden_size=512, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = [[5, 6, 7, 8, 9, 10], list(range(20, 61))]
    runs = {}
    for choice in ("triton", "cuda"):
        monkeypatch.setenv("DOVETAIL_CUDA_FP8_GEMV", choice)
        calls = []
        original = quant_kernels.native_gemv.launch
        monkeypatch.setattr(quant_kernels.native_gemv, "launch",  # launch(..., gated) is called positionally
                            lambda *a: calls.append(a[-1]) or original(*a))
        llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", quantization="fp8", attention_backend="TRITON",
                  gpu_memory_utilization=0.1, max_num_seqs=1, enforce_eager=True)
        runs[choice] = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                           use_tqdm=False)]
        assert (choice == "cuda") == bool(calls) and (choice != "cuda" or (True in calls and False in calls))
        monkeypatch.setattr(quant_kernels.native_gemv, "launch", original)
        del llm
        gc.collect()
    for reference, ours in zip(runs["triton"], runs["cuda"]):
        step = next((i for i, (a, b) in enumerate(zip(reference.token_ids, ours.token_ids)) if a != b), None)
        if step is not None:
            top2 = sorted((lp.logprob for lp in reference.logprobs[step].values()), reverse=True)[:2]
            assert top2[0] - top2[1] < 0.05, f"tokens diverge at step {step} without a near-tie: {top2}"
