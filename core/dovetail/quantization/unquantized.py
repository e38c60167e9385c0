"""The unquantized linear method: a plain floating-point weight."""

from __future__ import annotations

import torch

from dovetail.quantization.base import QuantMethod


class UnquantizedMethod(QuantMethod):
    """``y = x @ W.T + b`` with ``W`` in the model's dtype, through the platform's ``FusedOps.linear``."""

    name = "none"

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        weight = torch.nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype),
                                    requires_grad=False)
        weight.output_dim, weight.input_dim = 0, 1
        layer.register_parameter("weight", weight)

    def apply(self, layer, x, bias):
        return layer.ops.linear(x, layer.weight, bias)

    def apply_gated(self, layer, x, bias, activation):
        return layer.ops.linear_gated(x, layer.weight, bias, activation)
