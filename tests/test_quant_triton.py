"""The Triton dequantise-and-multiply kernel for GPTQ/AWQ weights against the reference definition.

Without a GPU the kernel runs in triton's CPU interpreter, switched on here
before triton is first imported (``TRITON_INTERPRET=1``); with a GPU the same
tests run the compiled kernel. Shapes are tiny and ragged (M, N and K not
multiples of the tiles) and act-order ``g_idx`` scatters groups over K.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from dovetail.quantization import quant_ops  # noqa: E402
from dovetail.quantization.gpu_kernels import GpuQuantKernels  # noqa: E402
from dovetail.quantization.kernels import QuantKernels  # noqa: E402
from dovetail.triton.quant_wna16 import INTERPRETED, wna16_linear_triton  # noqa: E402

#: Relative to max |output|: float32 IEEE dot; float16 and bfloat16 round the dequantised weight
#: (and the output) to 11 and 8 significant bits.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module", autouse=True)
def kernels_can_run_here():
    if DEVICE == "cpu" and not INTERPRETED:
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run on the CPU "
                    "in this process; something collected earlier imports triton at import time")


def packed_weight(k, n, groups, bits, seed, act_order):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (k, n), generator=gen)
    scales = torch.rand(groups, n, generator=gen) * 0.05 + 1e-3
    zeros = torch.randint(0, 2**bits, (groups, n), generator=gen).float()
    g_idx = torch.randperm(k, generator=gen) % groups if act_order else torch.arange(k) * groups // k
    return quant_ops.pack_int32(q, bits, 0), scales, zeros, g_idx.int()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k,n,act_order", [(5, 72, 40, True), (19, 128, 96, False)], ids=["ragged-actorder", "m19"])
def test_triton_wna16_matches_the_reference(bits, dtype, m, k, n, act_order):
    qweight, scales, zeros, g_idx = packed_weight(k, n, 3, bits, seed=m + bits, act_order=act_order)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    expected = QuantKernels().wna16_linear(x, qweight, scales, zeros, g_idx, bits, bias)
    args = [t.to(DEVICE) for t in (x, qweight, scales, zeros, g_idx)]
    out = wna16_linear_triton(*args, bits, bias.to(DEVICE), block_k=16).cpu()
    assert out.dtype == dtype and out.shape == (m, n)
    err = float((out.float() - expected.float()).abs().max() / expected.float().abs().max())
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


def test_triton_wna16_rejects_inconsistent_shapes():
    qweight, scales, zeros, g_idx = packed_weight(64, 16, 2, 4, seed=0, act_order=False)
    with pytest.raises(ValueError, match="do not describe one 4-bit"):
        wna16_linear_triton(torch.randn(3, 32), qweight, scales, zeros, g_idx, 4)


def test_gpu_kernels_run_a_loaded_gptq_layer(tiny_llama_dir, tmp_path):
    """A GPTQ act-order layer loaded through LLM computes the same with the GPU kernels as with the reference."""
    from dovetail import LLM
    from test_quant_checkpoints import build_gptq

    path, _ = build_gptq(tiny_llama_dir, tmp_path / "gptq", 32, True, False)
    llm = LLM(str(path), attention_backend="REFERENCE", dtype="float32", kv_cache_memory_bytes=2**24,
              gpu_memory_utilization=0.2)
    layer = llm.llm_engine.model.get_submodule("model.layers.1.self_attn.qkv_proj")
    x = torch.randn(4, layer.input_size, device=layer.qweight.device)
    with torch.no_grad():
        layer.quant_kernels = QuantKernels()
        expected = layer(x)
        layer.quant_kernels = GpuQuantKernels()
        out = layer(x)
    assert float((out - expected).abs().max() / expected.abs().max()) < TOLERANCE[torch.float32]
