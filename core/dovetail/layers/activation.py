"""Activations of MLPs: gated ones through the platform's fused ops, and the plain ones of MLPs without a
gate (through torch)."""

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


#: Plain (not gated) activations by HF ``hidden_act`` name.
PLAIN_ACTIVATIONS = {
    "gelu": lambda x: torch.nn.functional.gelu(x),
    "gelu_pytorch_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "relu": torch.relu,
    "relu2": lambda x: torch.relu(x).square(),
    "silu": torch.nn.functional.silu,
    "swish": torch.nn.functional.silu,
}


class PlainActivation(nn.Module):
    """``act(x)`` of an MLP without a gate (StarCoder 2, Arcee)."""

    def __init__(self, hidden_act: str):
        super().__init__()
        if hidden_act not in PLAIN_ACTIVATIONS:
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (supported: "
                             f"{', '.join(sorted(PLAIN_ACTIVATIONS))})")
        self.name = hidden_act
        self.fn = PLAIN_ACTIVATIONS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)
