"""The packed 4/8-bit weight layout GPTQ and AWQ checkpoints are converted to at load.

After loading, a layer holds ``qweight`` (int32, values packed along the input
dimension), ``scales`` and ``zeros`` (float32 ``[groups, N]``), ``g_idx`` (int32
``[K]``) and ``wna16_bits``; :meth:`dovetail.quantization.kernels.QuantKernels.wna16_linear`
defines the math. One layout means one kernel per platform for both formats.
"""

from __future__ import annotations

import torch

from dovetail.distributed.partition import WHOLE
from dovetail.errors import ConfigError
from dovetail.quantization.params import replace_param


def num_groups(input_size: int, group_size: int) -> int:
    return 1 if group_size == -1 else -(-input_size // group_size)


def check_group_size(group_size) -> int:
    if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
        raise ConfigError(f"quantization_config.group_size: must be -1 or a positive integer (got {group_size!r})")
    return group_size


def check_packable(layer, input_size: int, output_sizes: list[int], pack_input: int, pack_output: int) -> None:
    """Packed tensors need whole int32 words along each packed dimension, per shard."""
    if input_size % pack_input:
        raise ConfigError(f"layer {layer.prefix}: input size {input_size} is not a multiple of {pack_input}, "
                          "the values per packed word")
    bad = [size for size in output_sizes if size % pack_output]
    if bad:
        raise ConfigError(f"layer {layer.prefix}: output size(s) {bad} are not multiples of {pack_output}, "
                          "the values per packed zero-point word")


def finish(layer, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
           bits: int, drop: tuple[str, ...] = ()) -> None:
    """Install the canonical tensors on ``layer`` and drop the checkpoint-only ones."""
    for name in drop:
        layer._parameters.pop(name, None)
    replace_param(layer, "qweight", qweight.contiguous())
    replace_param(layer, "scales", scales.float().contiguous())
    replace_param(layer, "zeros", zeros.float().contiguous())
    replace_param(layer, "g_idx", g_idx.to(torch.int32).contiguous())
    layer.wna16_bits = bits


def splits_groups(layer, group_size: int, act_order: bool) -> bool:
    """Whether this rank of a row-parallel layer holds only its own groups' scales and zeros: its slice of the
    inputs is whole groups, in order. Otherwise (act-order, a single group, groups across ranks) it holds every
    group's, as vLLM does, and its ``g_idx`` keeps indexing them."""
    part = getattr(layer, "input_part", WHOLE)
    return not part.whole and group_size != -1 and not act_order and layer.input_size % group_size == 0


def rank_num_groups(layer, group_size: int, splits: bool) -> int:
    """Rows of this rank's ``scales`` and zeros (see :func:`splits_groups`)."""
    total = getattr(layer, "total_input_size", layer.input_size)
    return num_groups(layer.input_size if splits else total, group_size)


def rank_g_idx(layer, group_size: int, loaded: torch.Tensor | None, splits: bool) -> torch.Tensor:
    """The group of each of this rank's input features, as a row of the scales it holds; ``loaded`` is the
    checkpoint's ``g_idx`` slice (None: the default ``k // group_size``)."""
    start = getattr(layer, "input_part", WHOLE).index * layer.input_size
    if loaded is None:
        device = layer.scales.device
        if group_size == -1:
            return torch.zeros(layer.input_size, dtype=torch.int32, device=device)
        loaded = torch.arange(start, start + layer.input_size, dtype=torch.int32, device=device) // group_size
    return loaded - start // group_size if splits else loaded


def apply(layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return layer.quant_kernels.wna16_linear(x, layer.qweight, layer.scales, layer.zeros, layer.g_idx,
                                            layer.wna16_bits, bias)
