"""Programmatic dependent launch (``dovetail.triton.pdl``): where it is on, and that chains of PDL kernels
stay correct on a GPU that has it (each kernel reads the one before's output, eagerly and in a CUDA graph)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():  # as the other kernel tests: triton must not be imported before this is set
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")


def test_pdl_is_off_on_the_cpu_and_the_options_follow_the_flag():
    from dovetail.triton.pdl import launch_kwargs, use_pdl

    assert use_pdl(torch.device("cpu")) is False
    assert launch_kwargs(False) == {"USE_PDL": False}
    assert launch_kwargs(True) == {"USE_PDL": True, "launch_pdl": True}


def test_the_environment_switch_turns_pdl_off():
    code = ("import torch; from dovetail.triton.pdl import _use_pdl_on; "
            "print('off' if not _use_pdl_on('cuda', 0) else 'on')")
    env = dict(os.environ, DOVETAIL_TRITON_PDL="0")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0 and result.stdout.strip() == "off", result.stderr


def _chain(ops, x, residual, weights):
    """Dependent kernels back to back: add-RMSNorm, GEMV, SiLU-and-mul, GEMV, RMSNorm, per round."""
    from dovetail.triton.gemv import gemv

    linear = gemv if ops.name == "triton" else ops.linear  # two rows: TritonFusedOps.linear would take cuBLAS
    for w_up, w_down, norm_w in weights:
        h, residual = ops.add_rms_norm(x, residual, norm_w, 1e-6)
        h = ops.silu_and_mul(linear(h, w_up))
        x = linear(h, w_down)
        x = ops.rms_norm(x, norm_w, 1e-6)
    return x, residual


@pytest.mark.gpu
def test_a_chain_of_pdl_kernels_matches_torch_eagerly_and_in_a_graph():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs an NVIDIA GPU with programmatic dependent launch (sm_90 or newer)")
    from dovetail.ops import FusedOps
    from dovetail.triton.fused_ops import TritonFusedOps
    from dovetail.triton.pdl import use_pdl

    assert use_pdl(torch.device("cuda")), "PDL should be on for this GPU"
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden, inter = 512, 1024
    weights = [(torch.randn(2 * inter, hidden, device="cuda", generator=gen).bfloat16() * 0.05,
                torch.randn(hidden, inter, device="cuda", generator=gen).bfloat16() * 0.05,
                torch.rand(hidden, device="cuda", generator=gen).bfloat16() + 0.5) for _ in range(8)]
    x = torch.randn(2, hidden, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(2, hidden, device="cuda", generator=gen).bfloat16()
    want, _ = _chain(FusedOps(), x.float(), residual.float(), [tuple(t.float() for t in w) for w in weights])
    eager, _ = _chain(TritonFusedOps(), x, residual, weights)
    torch.testing.assert_close(eager.float(), want, atol=0.1, rtol=0.05)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, _ = _chain(TritonFusedOps(), x, residual, weights)
    for _ in range(5):
        graph.replay()
        assert torch.equal(captured, eager)
    x.copy_(x.flip(0))
    residual.copy_(residual.flip(0))
    graph.replay()
    assert torch.equal(captured, eager.flip(0))


def test_linear_routing_to_the_triton_gemv():
    """Few 16-bit tokens on a Hopper GPU go to the GEMV; anything else (CPU, float32, many tokens) to F.linear."""
    from dovetail.triton.fused_ops import GEMV_MAX_ROWS, TritonFusedOps, gemv_applies

    w = torch.randn(8, 16, dtype=torch.bfloat16)
    assert not gemv_applies(torch.randn(1, 16, dtype=torch.bfloat16), w, None)  # a CPU tensor
    assert TritonFusedOps().gemv_max_rows == 0  # only a platform that measured the GEMV faster turns it on
    assert TritonFusedOps().gated_gemv_max_rows == 0
    assert TritonFusedOps(gated_gemv_max_rows=8).linear_gated(torch.randn(1, 16, dtype=torch.bfloat16), w, None,
                                                              "silu") is None  # a CPU tensor: the two steps
    if torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability()[0] == 9:
        from dovetail_cuda.platform import CudaPlatform

        assert CudaPlatform().fused_ops().gemv_max_rows == GEMV_MAX_ROWS
        w = w.cuda()
        assert gemv_applies(torch.randn(GEMV_MAX_ROWS, 16, device="cuda", dtype=torch.bfloat16), w, None)
        assert not gemv_applies(torch.randn(GEMV_MAX_ROWS + 1, 16, device="cuda", dtype=torch.bfloat16), w, None)
        assert gemv_applies(torch.randn(1, 16, device="cuda", dtype=torch.bfloat16),  # a vocabulary-sized LM head
                            torch.randn(151936, 16, device="cuda", dtype=torch.bfloat16), None)
        assert not gemv_applies(torch.randn(1, 16, device="cuda"), w.float(), None)
        assert not gemv_applies(torch.randn(0, 16, device="cuda", dtype=torch.bfloat16), w, None)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 16, 64, 65])
def test_gated_projections_of_few_tokens_run_the_gated_gemv_on_the_gpu(m):
    """An MLP's merged gate/up layer with SiLU through ``forward_gated``: up to ``gated_gemv_max_rows`` tokens one
    gated GEMV (the same values as cuBLAS's product and the activation, within bfloat16 rounding), in a CUDA
    graph too; more tokens the two steps."""
    from dovetail.layers.activation import SiluAndMul
    from dovetail.quantization.unquantized import UnquantizedMethod
    from dovetail.triton.fused_ops import TritonFusedOps

    ops = TritonFusedOps(gated_gemv_max_rows=64)
    layer = torch.nn.Module()
    layer.ops = ops
    gen = torch.Generator(device="cuda").manual_seed(m)
    layer.weight = torch.randn(2 * 7168, 4096, device="cuda", generator=gen).bfloat16() * 0.02
    x = torch.randn(m, 4096, device="cuda", generator=gen).bfloat16()
    method = UnquantizedMethod()
    activation = SiluAndMul(type("Ctx", (), {"ops": ops})())
    fused = method.apply_gated(layer, x, None, activation.name)
    assert (fused is None) == (m > 64)
    want = activation(torch.nn.functional.linear(x, layer.weight))
    if fused is None:
        return
    torch.testing.assert_close(fused, want, atol=0.02, rtol=0.02)
    graph, out = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        out = method.apply_gated(layer, x, None, activation.name)
    x.copy_(torch.randn(m, 4096, device="cuda", generator=gen).bfloat16())
    graph.replay()
    torch.testing.assert_close(out, activation(torch.nn.functional.linear(x, layer.weight)), atol=0.02, rtol=0.02)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5])
def test_triton_fused_ops_linear_matches_f_linear_on_the_gpu(m):
    import torch.nn.functional as F

    from dovetail.triton.fused_ops import TritonFusedOps

    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 4096, device="cuda", generator=gen).bfloat16()
    w = torch.randn(6144, 4096, device="cuda", generator=gen).bfloat16() * 0.02
    b = torch.randn(6144, device="cuda", generator=gen).bfloat16()
    want = x.float() @ w.float().t() + b.float()
    got = TritonFusedOps(gemv_max_rows=1).linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, 6144)
    torch.testing.assert_close(got.float(), want, atol=0.03, rtol=0.01)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=0.03, rtol=0.01)
