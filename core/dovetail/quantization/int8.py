"""INT8 W8A8: symmetric per-channel int8 weights, int8 activations, int32 accumulation.

``--quantization int8`` on a 16/32-bit checkpoint quantizes every linear weight
at load (one scale per output channel) and each token's activations at run
time. Pre-quantized W8A8 INT8 checkpoints are written by llm-compressor in the
compressed-tensors format (:mod:`dovetail.quantization.compressed_tensors`),
which uses :class:`Int8Scheme` too; no tool writes ``quant_method: "int8"``.
"""

from __future__ import annotations

import torch

from dovetail.errors import ConfigError
from dovetail.quantization import quant_ops
from dovetail.quantization.base import QuantMethod
from dovetail.quantization.params import add_param, channel_scale_loader, max_scalar_loader, replace_param


class Int8Scheme:
    """How one linear layer stores and applies INT8 weights.

    - ``serialized``: the checkpoint holds int8 ``weight`` and ``weight_scale``
      (per tensor or per channel) tensors; else float weights are quantized after loading.
    - ``static``: activations use a calibrated per-tensor ``input_scale``.
    """

    def __init__(self, serialized: bool, static: bool = False):
        self.serialized = serialized
        self.static = static

    def create_weights(self, layer, input_size: int, output_sizes: list[int], params_dtype: torch.dtype) -> None:
        out = sum(output_sizes)
        if not self.serialized:
            add_param(layer, "weight", (out, input_size), params_dtype, output_dim=0, input_dim=1)
            return
        add_param(layer, "weight", (out, input_size), torch.int8, output_dim=0, input_dim=1)
        add_param(layer, "weight_scale", (out,), torch.float32, output_dim=0,
                  loader=channel_scale_loader(layer, "weight_scale"))
        if self.static:
            add_param(layer, "input_scale", (), torch.float32, loader=max_scalar_loader(layer, "input_scale"))

    def process_weights_after_loading(self, layer) -> None:
        if not self.serialized:
            weight, scale = quant_ops.quantize_int8_per_channel(layer.weight.data)
            replace_param(layer, "weight", weight)
            replace_param(layer, "weight_scale", scale)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return layer.quant_kernels.int8_linear(x, layer.weight, layer.weight_scale, bias,
                                               input_scale=layer.input_scale if self.static else None)


class Int8Method(QuantMethod):
    """``--quantization int8``: weights quantized at load, activations per token (dynamic)."""

    name = "int8"
    supported_platforms = ("*",)
    supported_act_dtypes = ("float32", "float16", "bfloat16")

    @classmethod
    def from_config(cls, hf_quant_config):
        if hf_quant_config:
            raise ConfigError("quantization_config.quant_method: no checkpoint format is named 'int8'; "
                              "W8A8 INT8 checkpoints (llm-compressor) are read as 'compressed-tensors', and "
                              "--quantization int8 quantizes a 16/32-bit checkpoint at load")
        return cls(None)

    def __init__(self, config=None):
        super().__init__(config)
        self.scheme = Int8Scheme(serialized=False)

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        self.scheme.create_weights(layer, input_size, output_sizes, params_dtype)

    def process_weights_after_loading(self, layer):
        self.scheme.process_weights_after_loading(layer)

    def apply(self, layer, x, bias):
        return self.scheme.apply(layer, x, bias)
