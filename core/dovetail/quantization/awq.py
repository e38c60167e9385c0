"""AWQ: 4-bit weights from AutoAWQ / llm-awq GEMM checkpoints (``quant_method: awq``).

Per linear layer (``version``/``format`` ``"gemm"``), 8 values per int32 word:

- ``qweight`` int32 ``[K, N / 8]``: packed along the output dimension; bit field
  ``i`` (bits ``4i .. 4i+3``) of word ``c`` holds column ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]``;
- ``qzeros`` int32 ``[groups, N / 8]``: zero points, packed the same way;
- ``scales`` float16 ``[groups, N]``, ``groups = K / group_size``.

``W[k, n] = (q[k, n] - z[k // group_size, n]) * scales[k // group_size, n]``.
The GEMV layouts (``gemv``, ``gemv_fast``) and checkpoints without zero points
are not supported.
"""

from __future__ import annotations

import torch

from dovetail.errors import ConfigError
from dovetail.quantization import quant_ops, wna16
from dovetail.quantization.base import QuantMethod
from dovetail.quantization.matching import layer_matches
from dovetail.quantization.params import add_param

BITS = 4


class AwqMethod(QuantMethod):
    """AWQ GEMM checkpoints, converted at load to the packed layout of :mod:`dovetail.quantization.wna16`."""

    name = "awq"
    supported_platforms = ("*",)
    supported_act_dtypes = ("float32", "float16", "bfloat16")
    checkpoint_only = True

    def __init__(self, config=None):
        super().__init__(config)
        cfg = self.config
        self.pre_quantized = bool(cfg)
        self.skip = list(cfg.get("modules_to_not_convert") or [])
        if not cfg:
            return
        if cfg.get("bits", BITS) != BITS:
            raise ConfigError(f"quantization_config.bits: AWQ with {cfg.get('bits')!r} bits is not supported "
                              f"(supported: {BITS})")
        self.group_size = wna16.check_group_size(cfg.get("group_size", 128))
        version = str(cfg.get("version") or cfg.get("format") or "gemm").lower()
        if version != "gemm":
            raise ConfigError(f"quantization_config.version: AWQ layout {version!r} is not supported "
                              "(supported: gemm)")
        if not cfg.get("zero_point", True):
            raise ConfigError("quantization_config.zero_point: AWQ without zero points is not supported")

    def quantizes(self, prefix: str) -> bool:
        return not layer_matches(prefix, self.skip, "modules_to_not_convert")

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        pack = 32 // BITS
        wna16.check_packable(layer, input_size, output_sizes, pack, pack)
        total_input = getattr(layer, "total_input_size", input_size)
        if self.group_size != -1 and total_input % self.group_size:
            raise ConfigError(f"layer {layer.prefix}: input size {total_input} is not a multiple of "
                              f"quantization_config.group_size {self.group_size}")
        out = sum(output_sizes)
        splits = wna16.splits_groups(layer, self.group_size, False)
        groups = wna16.rank_num_groups(layer, self.group_size, splits)
        group_dim = 0 if splits else None
        add_param(layer, "qweight", (input_size, out // pack), torch.int32, output_dim=1, input_dim=0)
        add_param(layer, "qzeros", (groups, out // pack), torch.int32, output_dim=1, input_dim=group_dim)
        add_param(layer, "scales", (groups, out), torch.float32, output_dim=1, input_dim=group_dim)

    def process_weights_after_loading(self, layer):
        values = quant_ops.unpack_int32(layer.qweight.data, BITS, dim=1, order=quant_ops.AWQ_PACK_ORDER)
        qweight = quant_ops.pack_int32(values, BITS, dim=0)
        zeros = quant_ops.unpack_int32(layer.qzeros.data, BITS, dim=1, order=quant_ops.AWQ_PACK_ORDER)
        g_idx = wna16.rank_g_idx(layer, self.group_size, None, wna16.splits_groups(layer, self.group_size, False))
        wna16.finish(layer, qweight, layer.scales.data, zeros, g_idx, BITS, drop=("qzeros",))

    def apply(self, layer, x, bias):
        return wna16.apply(layer, x, bias)
