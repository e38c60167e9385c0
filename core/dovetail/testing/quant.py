"""A quantization method's round trip: quantize a float weight, load it, apply it."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dovetail.ops import FusedOps
from dovetail.quantization.base import QuantMethod
from dovetail.quantization.kernels import QuantKernels


class _Layer(nn.Module):
    """A bare layer carrying what Linear gives a method: sizes, prefix, kernels, fused ops."""

    def __init__(self, input_size: int, output_sizes: list[int], kernels: QuantKernels):
        super().__init__()
        self.input_size = input_size
        self.output_sizes = output_sizes
        self.output_size = sum(output_sizes)
        self.prefix = "conformance.linear"
        self.quant_kernels = kernels
        self.ops = FusedOps()


def check_quant_roundtrip(method: QuantMethod, quantize: Callable[[torch.Tensor], dict[str, torch.Tensor]],
                          input_size: int = 256, output_sizes: tuple[int, ...] = (128, 64),
                          dtype: torch.dtype = torch.float32, device: str = "cpu", rel_tol: float = 0.05,
                          kernels: QuantKernels | None = None, seed: int = 0) -> float:
    """``apply`` on the loaded quantized weight must match ``x @ W.T`` within ``rel_tol`` (relative error).

    ``quantize(W)`` returns the checkpoint tensors of one linear layer by parameter
    name (e.g. ``{"weight": ..., "weight_scale": ...}``). Returns the measured error.
    """
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(sum(output_sizes), input_size, generator=gen) * 0.05
    layer = _Layer(input_size, list(output_sizes), kernels or QuantKernels())
    method.create_weights(layer, input_size, list(output_sizes), dtype)
    params = dict(layer.named_parameters())
    for name, tensor in quantize(weight).items():
        assert name in params, f"{type(method).__name__}.create_weights made no parameter {name!r}"
        assert params[name].shape == tensor.shape, \
            f"parameter {name!r} has shape {tuple(params[name].shape)}, the checkpoint {tuple(tensor.shape)}"
        loader = getattr(params[name], "weight_loader", None)
        if loader is not None:
            loader(params[name], tensor, None)
        else:
            params[name].data.copy_(tensor)
    layer.to(device)
    method.process_weights_after_loading(layer)
    x = torch.randn(11, input_size, generator=gen).to(device=device, dtype=dtype)
    got = method.apply(layer, x, None).float().cpu()
    want = x.float().cpu() @ weight.t()
    error = ((got - want).norm() / want.norm()).item()
    assert error <= rel_tol, f"{type(method).__name__} relative error {error:.3g} exceeds {rel_tol}"
    return error
