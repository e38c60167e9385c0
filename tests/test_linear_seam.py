"""Unquantized linear layers and the LM head go through the platform's ``FusedOps.linear``; a merged gate/up
layer asks its quantization method for a fused activation kernel (``Linear.forward_gated``)."""

from __future__ import annotations

import dataclasses

import torch

from dovetail.layers.activation import GeluTanhAndMul, SiluAndMul
from dovetail.layers.embedding import LMHead
from dovetail.layers.linear import Linear
from dovetail.model_interface import ModelContext
from dovetail.ops import FusedOps
from dovetail.quantization.fp8 import Fp8Method
from dovetail.quantization.kernels import QuantKernels
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


class FusingKernels(QuantKernels):
    """Reference FP8 kernels plus a 'fused' gate/up kernel that records its calls and answers from the definition."""

    def __init__(self):
        self.gated = []

    def fp8_linear_gated(self, x, weight, weight_scale, bias, activation, *, input_scale=None, block_size=None):
        self.gated.append(activation)
        if activation != "silu":
            return None
        y = self.fp8_linear(x, weight, weight_scale, bias).float()
        half = y.shape[-1] // 2
        return (torch.nn.functional.silu(y[..., :half]) * y[..., half:]).to(x.dtype)


def test_forward_gated_takes_the_methods_fused_kernel_or_falls_back_to_two_steps():
    kernels = FusingKernels()
    ctx = ModelContext(dtype=torch.float32, device=torch.device("cpu"), quant=Fp8Method(), attention_backend=None,
                       ops=FusedOps(), quant_kernels=kernels)
    gate_up = Linear(16, [24, 24], False, ctx, prefix="mlp.gate_up_proj")
    gate_up.weight.data.normal_()
    gate_up.method.process_weights_after_loading(gate_up)
    x = torch.randn(3, 16)
    two_steps = SiluAndMul(ctx)(gate_up(x))
    torch.testing.assert_close(gate_up.forward_gated(x, SiluAndMul(ctx)), two_steps)
    assert kernels.gated == ["silu"]
    gelu = GeluTanhAndMul(ctx)
    torch.testing.assert_close(gate_up.forward_gated(x, gelu), gelu(gate_up(x)))  # no fused kernel: two steps
    assert kernels.gated == ["silu", "gelu_tanh"]
    assert QuantKernels().fp8_linear_gated(x, gate_up.weight, gate_up.weight_scale, None, "silu") is None
    plain = Linear(16, [24, 24], False, dataclasses.replace(ctx, quant=UnquantizedMethod()), prefix="mlp")
    plain.weight.data.normal_()
    torch.testing.assert_close(plain.forward_gated(x, SiluAndMul(ctx)), SiluAndMul(ctx)(plain(x)))
