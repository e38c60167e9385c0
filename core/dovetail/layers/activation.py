"""Gated activations of MLPs, through the platform's fused ops."""

from __future__ import annotations

import torch
from torch import nn

from dovetail.model_interface import ModelContext


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` over a merged ``[gate | up]`` input."""

    #: What a fused projection-and-activation kernel is asked for (``QuantKernels.fp8_linear_gated``).
    name = "silu"

    def __init__(self, ctx: ModelContext):
        super().__init__()
        self.ops = ctx.ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(gate) * up`` over a merged ``[gate | up]`` input (Gemma)."""

    name = "gelu_tanh"

    def __init__(self, ctx: ModelContext):
        super().__init__()
        self.ops = ctx.ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.gelu_tanh_and_mul(x)


class GeluAndMul(nn.Module):
    """Exact (erf) ``gelu(gate) * up`` over a merged ``[gate | up]`` input."""

    name = "gelu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return torch.nn.functional.gelu(x[..., :d]) * x[..., d:]


def gated_activation(hidden_act: str, ctx: ModelContext) -> nn.Module:
    """The gated activation module for an HF ``hidden_act`` name."""
    if hidden_act in ("silu", "swish"):
        return SiluAndMul(ctx)
    if hidden_act in ("gelu_pytorch_tanh", "gelu_tanh"):
        return GeluTanhAndMul(ctx)
    if hidden_act == "gelu":
        return GeluAndMul()
    raise ValueError(f"hidden_act {hidden_act!r} is not supported (supported: silu, gelu, gelu_pytorch_tanh)")
