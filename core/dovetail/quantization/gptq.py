"""GPTQ: 4- or 8-bit weights from AutoGPTQ / GPTQModel / optimum checkpoints (``quant_method: gptq``).

Per linear layer, with ``p = 32 // bits`` values per int32 word (low bits first):

- ``qweight`` int32 ``[K / p, N]``: packed along the input dimension;
- ``qzeros`` int32 ``[groups, N / p]``: zero points packed along the output dimension;
- ``scales`` float16 ``[groups, N]``, ``groups = ceil(K / group_size)`` (1 for ``group_size: -1``);
- ``g_idx`` int32 ``[K]``: the group of each input feature; with act-order
  (``desc_act: true``) it follows the order GPTQ quantized the features in.

``W[k, n] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n]``. The classic format
(``checkpoint_format``/``format`` ``"gptq"``, the default) stores ``z - 1`` in
``qzeros``, as AutoGPTQ did; ``"gptq_v2"`` stores ``z``. Symmetric checkpoints
(``sym: true``) store the middle value (8 for 4 bits) like any other zero point.
"""

from __future__ import annotations

import torch

from dovetail.errors import ConfigError, ModelLoadError
from dovetail.quantization import quant_ops, wna16
from dovetail.quantization.base import QuantMethod
from dovetail.quantization.matching import layer_matches
from dovetail.quantization.params import add_param, same_on_every_shard_loader

SUPPORTED_BITS = (4, 8)
FORMATS = {"gptq": 1, "gptq_v2": 2}


class GptqMethod(QuantMethod):
    """GPTQ checkpoints, converted at load to the packed layout of :mod:`dovetail.quantization.wna16`."""

    name = "gptq"
    supported_platforms = ("*",)
    supported_act_dtypes = ("float32", "float16", "bfloat16")
    checkpoint_only = True

    def __init__(self, config=None):
        super().__init__(config)
        cfg = self.config
        self.pre_quantized = bool(cfg)
        if not cfg:
            return
        self.bits = cfg.get("bits")
        if self.bits not in SUPPORTED_BITS:
            raise ConfigError(f"quantization_config.bits: GPTQ with {self.bits!r} bits is not supported "
                              f"(supported: {', '.join(map(str, SUPPORTED_BITS))})")
        self.group_size = wna16.check_group_size(cfg.get("group_size", 128))
        self.desc_act = bool(cfg.get("desc_act", False))
        fmt = str(cfg.get("checkpoint_format") or cfg.get("format") or "gptq").lower()
        if fmt not in FORMATS:
            raise ConfigError(f"quantization_config.checkpoint_format: GPTQ format {fmt!r} is not supported "
                              f"(supported: {', '.join(FORMATS)})")
        self.zero_offset = 1 if FORMATS[fmt] == 1 else 0
        if cfg.get("lm_head"):
            raise ConfigError("quantization_config.lm_head: a GPTQ-quantized lm_head is not supported")
        if cfg.get("dynamic"):
            raise ConfigError("quantization_config.dynamic: per-module GPTQ overrides are not supported")
        blocks = cfg.get("modules_in_block_to_quantize")
        self.only = [name for group in blocks for name in group] if blocks else None

    def quantizes(self, prefix: str) -> bool:
        return self.only is None or layer_matches(prefix, self.only, "modules_in_block_to_quantize")

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        pack = 32 // self.bits
        wna16.check_packable(layer, input_size, output_sizes, pack, pack)
        out = sum(output_sizes)
        splits = wna16.splits_groups(layer, self.group_size, self.desc_act)
        groups = wna16.rank_num_groups(layer, self.group_size, splits)
        group_dim = 0 if splits else None
        add_param(layer, "qweight", (input_size // pack, out), torch.int32, output_dim=1, input_dim=0)
        add_param(layer, "qzeros", (groups, out // pack), torch.int32, output_dim=1, input_dim=group_dim)
        add_param(layer, "scales", (groups, out), torch.float32, output_dim=1, input_dim=group_dim)
        g_idx = add_param(layer, "g_idx", (input_size,), torch.int32, input_dim=0,
                          loader=same_on_every_shard_loader(layer, "g_idx"))
        g_idx.load_optional = not self.desc_act  # without act-order, g_idx is k // group_size; some tools omit it

    def process_weights_after_loading(self, layer):
        zeros = quant_ops.unpack_int32(layer.qzeros.data, self.bits, dim=1) + self.zero_offset
        loaded = layer.g_idx.data if getattr(layer.g_idx, "was_loaded", False) else None
        g_idx = wna16.rank_g_idx(layer, self.group_size, loaded, wna16.splits_groups(layer, self.group_size,
                                                                                     self.desc_act))
        groups = layer.scales.shape[0]
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise ModelLoadError(f"{layer.prefix}.g_idx: group indices must lie in [0, {groups}) "
                              f"(got {int(g_idx.min())}..{int(g_idx.max())}); does group_size match the checkpoint?")
        wna16.finish(layer, layer.qweight.data, layer.scales.data, zeros, g_idx, self.bits, drop=("qzeros",))

    def apply(self, layer, x, bias):
        return wna16.apply(layer, x, bias)
