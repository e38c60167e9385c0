"""Unquantized linear layers and the LM head go through the platform's ``FusedOps.linear``."""

from __future__ import annotations

import torch

from dovetail.layers.embedding import LMHead
from dovetail.layers.linear import Linear
from dovetail.model_interface import ModelContext
from dovetail.ops import FusedOps
from dovetail.quantization.unquantized import UnquantizedMethod


class RecordingOps(FusedOps):
    """Plain torch, recording the weight shape of each ``linear`` call."""

    def __init__(self):
        self.calls = []

    def linear(self, x, weight, bias=None):
        self.calls.append(tuple(weight.shape))
        return super().linear(x, weight, bias)


def test_linear_and_lm_head_call_the_platform_linear():
    ops = RecordingOps()
    ctx = ModelContext(dtype=torch.float32, device=torch.device("cpu"), quant=UnquantizedMethod(),
                       attention_backend=None, ops=ops)
    qkv, head = Linear(16, [16, 8, 8], True, ctx, prefix="qkv"), LMHead(50, 16, ctx)
    for param in (qkv.weight, qkv.bias, head.weight):
        param.data.normal_()
    x = torch.randn(3, 16)
    torch.testing.assert_close(qkv(x), torch.nn.functional.linear(x, qkv.weight, qkv.bias))
    torch.testing.assert_close(head(x), x @ head.weight.t())
    assert ops.calls == [(32, 16), (50, 16)]


def test_the_cpu_engine_builds_its_layers_with_the_cpu_linear(tiny_llama_dir):
    from dovetail import LLM
    from dovetail_cpu.ops import CpuFusedOps

    llm = LLM(str(tiny_llama_dir), device="cpu", attention_backend="CPU_SIMD", max_model_len=128)
    model = llm.llm_engine.model
    layers = [m for m in model.modules() if isinstance(m, (Linear, LMHead))]
    assert layers and all(isinstance(m.ops, CpuFusedOps) for m in layers)
