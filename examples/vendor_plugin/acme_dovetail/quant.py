"""``toy_int8``: weight-only int8 with one scale per output channel, dequantised on the fly."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dovetail.quantization.base import QuantMethod


def quantize_int8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one linear layer: int8 ``weight`` and float ``weight_scale``."""
    scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
    return {"weight": torch.round(weight / scale).clamp(-127, 127).to(torch.int8),
            "weight_scale": scale.squeeze(1).float()}


class ToyInt8Method(QuantMethod):
    """Weights stored as int8 with per-output-channel float scales; quantizes float checkpoints at load."""

    name = "toy_int8"
    supported_platforms = ("toy", "cpu")
    supported_act_dtypes = ("float32",)

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        total = sum(output_sizes)
        weight = torch.nn.Parameter(torch.empty(total, input_size, dtype=params_dtype), requires_grad=False)
        weight.output_dim, weight.input_dim = 0, 1  # how merged shards and tensor-parallel ranks split it
        scale = torch.nn.Parameter(torch.ones(total, dtype=torch.float32), requires_grad=False)
        scale.output_dim = 0
        scale.load_optional = True  # float checkpoints have no scale: it is computed at load
        layer.register_parameter("weight", weight)
        layer.register_parameter("weight_scale", scale)
        layer.toy_prequantized = False

        def load_weight(param, tensor, shard, _layer=layer):
            if tensor.dtype == torch.int8:
                _layer.toy_prequantized = True
            target = param.data
            if shard is not None:
                start = sum(_layer.output_sizes[:shard])
                target = target.narrow(0, start, _layer.output_sizes[shard])
            target.copy_(tensor)

        weight.weight_loader = load_weight

    def process_weights_after_loading(self, layer):
        if layer.toy_prequantized:
            q, scale = layer.weight.data.to(torch.int8), layer.weight_scale.data
        else:
            packed = quantize_int8(layer.weight.data.float())
            q, scale = packed["weight"], packed["weight_scale"]
        layer.weight = torch.nn.Parameter(q, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)

    def apply(self, layer, x, bias):
        weight = layer.weight.to(x.dtype) * layer.weight_scale.to(x.dtype).unsqueeze(1)
        return F.linear(x, weight, bias)
