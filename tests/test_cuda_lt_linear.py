"""Decode-sized linears on tuned cuBLASLt algorithms (``dovetail_cuda.lt_linear``) and their routing.

Without a GPU: which operands qualify, the switch variable, the build's link flag, and that the cuda platform's
fused ops route through it. With one (and nvcc with cuBLASLt's header): every candidate algorithm against the
float product on random operands, the tuned choice and its cache, graph capture (nothing timed inside one;
a tuned shape replays), and the fallbacks.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("dovetail_cuda")

from dovetail_cuda import lt_linear, native  # noqa: E402
from dovetail_cuda.fused_ops import CudaFusedOps  # noqa: E402


def test_applies_only_to_aligned_decode_sized_16_bit_operands():
    w = torch.randn(64, 32, dtype=torch.bfloat16)
    assert not lt_linear.applies(torch.randn(4, 32, dtype=torch.bfloat16), w, None)  # on the CPU
    if torch.cuda.is_available():
        wc, x = w.cuda(), torch.randn(4, 32, dtype=torch.bfloat16, device="cuda")
        assert lt_linear.applies(x, wc, None)
        assert not lt_linear.applies(x[:1], wc, None)  # one token: the GEMV's
        assert not lt_linear.applies(torch.randn(528, 32, dtype=torch.bfloat16, device="cuda"), wc, None)
        assert not lt_linear.applies(torch.randn(17, 32, dtype=torch.bfloat16, device="cuda"), wc, None)
        assert not lt_linear.applies(x, wc, torch.zeros(64, dtype=torch.bfloat16, device="cuda"))
        assert not lt_linear.applies(x.float(), wc.float(), None)
        assert not lt_linear.applies(x.t().contiguous().t(), wc, None)


def test_tuning_switch(monkeypatch):
    monkeypatch.delenv("DOVETAIL_CUDA_GEMM_TUNING", raising=False)
    assert lt_linear.tuning_enabled()
    for off in ("0", "false", "OFF"):
        monkeypatch.setenv("DOVETAIL_CUDA_GEMM_TUNING", off)
        assert not lt_linear.tuning_enabled()


def test_cuda_platform_routes_linears_through_the_tuned_ops(monkeypatch):
    pytest.importorskip("triton")
    from dovetail.triton import triton_missing_reason
    from dovetail_cuda.platform import CudaPlatform

    if triton_missing_reason():
        pytest.skip(triton_missing_reason())
    monkeypatch.delenv("DOVETAIL_CUDA_GEMM_TUNING", raising=False)
    assert isinstance(CudaPlatform().fused_ops(), CudaFusedOps)
    monkeypatch.setenv("DOVETAIL_CUDA_GEMM_TUNING", "0")
    assert not isinstance(CudaPlatform().fused_ops(), CudaFusedOps)


def test_build_links_cublaslt(tmp_path, monkeypatch):
    assert native.LINK_FLAGS[lt_linear.SOURCE] == ("-lcublasLt",)
    nvcc = native.nvcc_path()
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    from pathlib import Path

    if not any((Path(nvcc).resolve().parent.parent / sub / "cublasLt.h").exists()
               for sub in ("include", "targets/x86_64-linux/include")):
        pytest.skip("no cuBLASLt header beside this nvcc")
    monkeypatch.setenv("DOVETAIL_CACHE_DIR", str(tmp_path))
    built = native.build(lt_linear.SOURCE, (9, 0), nvcc)
    assert built.exists() and native.build(lt_linear.SOURCE, (9, 0), nvcc) == built


def needs_library():
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    reason = native.unavailable_reason(lt_linear.SOURCE, 0)
    if reason:
        pytest.skip(reason)


def _operands(m, n, k, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) / k ** 0.5
    return x, w, x.float() @ w.float().t()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(2, 384, 256), (16, 1000, 512), (64, 4096, 1024), (256, 6144, 4096)])
def test_every_candidate_matches_the_float_product(m, n, k, dtype):
    needs_library()
    x, w, ref = _operands(m, n, k, dtype, seed=m + n)
    tuned = lt_linear.TunedLinear()
    out = tuned(x, w)
    key = (0, lt_linear._DTYPES[dtype], m, n, k)
    assert out is not None and key in tuned.chosen()
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    lib = native.library(lt_linear.SOURCE, x.device)
    count = lib.dovetail_lt_algos(*(ctypes.c_int(v) for v in key), ctypes.c_int(lt_linear.CANDIDATES),
                                  ctypes.c_ulonglong(lt_linear.WORKSPACE_BYTES))
    assert 1 <= count <= lt_linear.CANDIDATES
    for algo in range(count):
        y = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
        assert tuned._run(key, algo, x, w, y) == 0
        torch.testing.assert_close(y.float(), ref, atol=tol, rtol=tol, msg=f"candidate {algo}")
    assert tuned._run(key, count, x, w, y) == -1  # no such candidate


@pytest.mark.gpu
def test_graph_capture_times_nothing_and_replays_a_tuned_shape():
    needs_library()
    x, w, ref = _operands(48, 2048, 1024, torch.bfloat16, seed=3)
    assert 48 in lt_linear.TUNED_ROWS
    ops = CudaFusedOps()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        assert ops.tuned_linear(x, w) is None  # first met inside a capture: F.linear's
    assert not ops.tuned_linear.chosen()
    eager = ops.linear(x, w)  # tunes
    assert len(ops.tuned_linear.chosen()) == 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        captured = ops.linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, ops.linear(x, w), atol=0, rtol=0)
    torch.testing.assert_close(eager.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_other_operands_fall_back_to_f_linear():
    needs_library()
    ops = CudaFusedOps()
    x, w, _ = _operands(8, 256, 128, torch.bfloat16, seed=5)
    bias = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(ops.linear(x, w, bias), F.linear(x, w, bias))
    torch.testing.assert_close(ops.linear(x.float(), w.float()), F.linear(x.float(), w.float()))
    assert not ops.tuned_linear.chosen()
