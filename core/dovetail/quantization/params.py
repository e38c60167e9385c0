"""Creating a quantized layer's parameters, and the loaders for those a plain copy cannot fill.

A merged layer (QKV, gate/up) receives one checkpoint tensor per shard (under
tensor parallelism, already narrowed to this rank's part); the loaders here place them: a per-tensor or per-channel scale as rows of a
per-channel vector, a static activation scale as the largest of the shards',
and a tensor every shard must agree on (GPTQ's ``g_idx``) once.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dovetail.errors import ModelLoadError


def add_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
              output_dim: int | None = None, loader: Callable | None = None,
              input_dim: int | None = None) -> nn.Parameter:
    """Register an uninitialised, frozen parameter ``name`` on ``layer``; ``output_dim`` and ``input_dim`` name
    the dimensions that index output and input features (how merged shards and tensor-parallel ranks split it)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.output_dim = output_dim
    param.input_dim = input_dim
    if loader is not None:
        param.weight_loader = loader
    layer.register_parameter(name, param)
    return param


def replace_param(layer: nn.Module, name: str, value: torch.Tensor) -> None:
    """Set ``layer.name`` to a frozen parameter holding ``value`` (registering it if new)."""
    if name in layer._parameters:
        del layer._parameters[name]
    layer.register_parameter(name, nn.Parameter(value, requires_grad=False))


def shard_rows(layer: nn.Module, shard: int | None) -> tuple[int, int]:
    """(first row, number of rows) of output shard ``shard`` (``None``: the whole layer)."""
    if shard is None:
        return 0, layer.output_size
    return sum(layer.output_sizes[:shard]), layer.output_sizes[shard]


def _where(layer: nn.Module, name: str, shard: int | None) -> str:
    return f"{layer.prefix}.{name}" + (f" (shard {shard})" if shard is not None else "")


def channel_scale_loader(layer: nn.Module, name: str) -> Callable:
    """Loads a per-tensor (one element) or per-channel (``[rows]`` / ``[rows, 1]``) scale into a ``[N]`` vector."""

    def load(param: nn.Parameter, tensor: torch.Tensor, shard: int | None) -> None:
        start, rows = shard_rows(layer, shard)
        flat = tensor.reshape(-1)
        if flat.numel() not in (1, rows):
            raise ModelLoadError(f"tensor for {_where(layer, name, shard)} has shape {tuple(tensor.shape)}: "
                                 f"expected one per-tensor scale or {rows} per-channel scales")
        param.data[start:start + rows].copy_(flat.expand(rows))

    return load


def max_scalar_loader(layer: nn.Module, name: str) -> Callable:
    """Loads a one-element static activation scale; several shards keep the largest."""
    seen: set = set()

    def load(param: nn.Parameter, tensor: torch.Tensor, shard: int | None) -> None:
        if tensor.numel() != 1:
            raise ModelLoadError(f"tensor for {_where(layer, name, shard)} has shape {tuple(tensor.shape)}: "
                                 "expected a single per-tensor activation scale")
        value = tensor.reshape(()).to(param.dtype)
        param.data.copy_(value if not seen else torch.maximum(param.data, value))
        seen.add(shard)

    return load


def same_on_every_shard_loader(layer: nn.Module, name: str) -> Callable:
    """Loads a tensor that every shard of a merged layer must carry identically (and marks ``was_loaded``)."""
    seen: set = set()

    def load(param: nn.Parameter, tensor: torch.Tensor, shard: int | None) -> None:
        if tuple(tensor.shape) != tuple(param.shape):
            raise ModelLoadError(f"tensor for {_where(layer, name, shard)} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
        if seen and not torch.equal(param.data, tensor.to(param.device, param.dtype)):
            raise ModelLoadError(f"{_where(layer, name, shard)} differs from the other shards of the merged "
                                 f"layer {layer.prefix}; they must be equal to be merged")
        param.data.copy_(tensor)
        param.was_loaded = True
        seen.add(shard)

    return load
