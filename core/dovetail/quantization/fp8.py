"""FP8 (e4m3) weights and activations: quantized at load, or read from FP8 checkpoints.

``--quantization fp8`` on a 16/32-bit checkpoint quantizes every linear weight
at load with one scale per output channel; activations are quantized per token
at run time. Checkpoints whose ``quantization_config.quant_method`` is ``"fp8"``
come in the layouts their tools write:

=====================================  =====================  ==========================  ==================
writer (config)                        weight scale tensor    shape                       static act. scale
=====================================  =====================  ==========================  ==================
AutoFP8 / vLLM (no weight_block_size)  ``weight_scale``       ``[]``/``[1]`` or ``[N]``   ``input_scale``
HF FineGrainedFP8, block_size null     ``weight_scale_inv``   ``[]``                      ``activation_scale``
HF FineGrainedFP8 / DeepSeek-V3        ``weight_scale_inv``   ``[ceil(N/bn), ceil(K/bk)]`` ``activation_scale``
=====================================  =====================  ==========================  ==================

(``weight_scale_inv`` multiplies, as ``weight_scale`` does: ``W = W_fp8 * s``.)
``activation_scheme`` is ``"dynamic"`` (per token, or per token and ``bk``
features with blocks) or ``"static"`` (one calibrated scale per tensor).
"""

from __future__ import annotations

from typing import Any

import torch

from dovetail.errors import ConfigError
from dovetail.quantization import quant_ops
from dovetail.quantization.base import QuantMethod
from dovetail.quantization.matching import layer_matches
from dovetail.quantization.params import add_param, channel_scale_loader, max_scalar_loader, replace_param


class Fp8Scheme:
    """How one linear layer stores and applies FP8 weights.

    - ``serialized``: the checkpoint holds FP8 weights (else float weights are quantized after loading).
    - ``block_size``: ``(bn, bk)`` for block scales; None for per-channel (or per-tensor) scales.
    - ``static``: activations use a calibrated per-tensor scale.
    - ``scale_name`` / ``input_scale_name``: the checkpoint's tensor names.
    """

    def __init__(self, serialized: bool, block_size: tuple[int, int] | None = None, static: bool = False,
                 scale_name: str = "weight_scale", input_scale_name: str = "input_scale"):
        self.serialized = serialized
        self.block_size = block_size
        self.static = static
        self.scale_name = scale_name
        self.input_scale_name = input_scale_name

    def create_weights(self, layer, input_size: int, output_sizes: list[int], params_dtype: torch.dtype) -> None:
        out = sum(output_sizes)
        if not self.serialized:
            add_param(layer, "weight", (out, input_size), params_dtype, output_dim=0, input_dim=1)
            return
        add_param(layer, "weight", (out, input_size), quant_ops.fp8_dtype(), output_dim=0, input_dim=1)
        if self.block_size is None:
            add_param(layer, self.scale_name, (out,), torch.float32, output_dim=0,
                      loader=channel_scale_loader(layer, self.scale_name))
        else:
            bn, bk = self.block_size
            if len(output_sizes) > 1 and any(size % bn for size in output_sizes):
                raise ConfigError(f"quantization_config.weight_block_size: layer {layer.prefix} merges outputs "
                                  f"of sizes {output_sizes}, which must be multiples of the block's {bn} rows")
            _check_rank_blocks(layer, input_size, output_sizes, bn, bk)
            add_param(layer, self.scale_name, (-(-out // bn), -(-input_size // bk)), torch.float32, output_dim=0,
                      input_dim=1)
        if self.static:
            add_param(layer, self.input_scale_name, (), torch.float32,
                      loader=max_scalar_loader(layer, self.input_scale_name))

    def process_weights_after_loading(self, layer) -> None:
        if not self.serialized:
            weight, scale = quant_ops.quantize_fp8_per_channel(layer.weight.data)
            replace_param(layer, "weight", weight)
            replace_param(layer, self.scale_name, scale)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return layer.quant_kernels.fp8_linear(x, layer.weight, getattr(layer, self.scale_name), bias,
                                              input_scale=self._input_scale(layer), block_size=self.block_size)

    def apply_gated(self, layer, x: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor | None:
        return layer.quant_kernels.fp8_linear_gated(x, layer.weight, getattr(layer, self.scale_name), bias, activation,
                                                    input_scale=self._input_scale(layer), block_size=self.block_size)

    def _input_scale(self, layer) -> torch.Tensor | None:
        return getattr(layer, self.input_scale_name) if self.static else None


def _check_rank_blocks(layer, input_size: int, output_sizes: list[int], bn: int, bk: int) -> None:
    """A rank's slice of a tensor-parallel layer must hold whole scale blocks (else a block straddles ranks)."""
    if any(not part.whole for part in getattr(layer, "output_parts", ())) and any(s % bn for s in output_sizes):
        raise ConfigError(f"quantization_config.weight_block_size: layer {layer.prefix} gives each rank "
                          f"{output_sizes} output rows, which must be multiples of the block's {bn} rows "
                          "(lower tensor_parallel_size)")
    input_part = getattr(layer, "input_part", None)
    if input_part is not None and not input_part.whole and input_size % bk:
        raise ConfigError(f"quantization_config.weight_block_size: layer {layer.prefix} gives each rank "
                          f"{input_size} input features, which must be a multiple of the block's {bk} columns "
                          "(lower tensor_parallel_size)")


def fp8_reasons(method: QuantMethod, platform) -> list[str]:
    """Why FP8 tensors cannot be used on ``platform``'s device (empty when they can)."""
    missing = quant_ops.fp8_missing_reason()
    if missing:
        return [f"quantization {method.name!r} needs FP8 tensors: {missing}"]
    try:
        probe = torch.ones(4, device=platform.device())
        probe.to(quant_ops.fp8_dtype()).float().sum().item()
    except Exception as exc:  # the device cannot store or convert float8_e4m3fn
        return [f"quantization {method.name!r} needs FP8 tensors, which device {platform.name!r} cannot "
                f"convert ({type(exc).__name__}: {exc})"]
    return []


class Fp8Method(QuantMethod):
    """FP8 W8A8: ``--quantization fp8`` on a float checkpoint, or an FP8 checkpoint (``quant_method: fp8``)."""

    name = "fp8"
    #: Everywhere torch holds FP8 tensors (checked by ``validate``): the reference kernel dequantizes.
    supported_platforms = ("*",)
    supported_act_dtypes = ("float32", "float16", "bfloat16")

    def __init__(self, config: dict[str, Any] | None = None):
        super().__init__(config)
        cfg = self.config
        self.skip = list(cfg.get("ignored_layers") or cfg.get("modules_to_not_convert") or [])
        if not cfg:
            self.scheme = Fp8Scheme(serialized=False)
            return
        scheme = cfg.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ConfigError(f"quantization_config.activation_scheme: must be 'dynamic' or 'static' (got {scheme!r})")
        fmt = cfg.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ConfigError(f"quantization_config.fmt: only 'e4m3' FP8 checkpoints are supported (got {fmt!r})")
        if cfg.get("modules_to_convert"):
            raise ConfigError("quantization_config.modules_to_convert: FP8 embeddings are not supported")
        if cfg.get("expert_dtype", "fp8") != "fp8":
            raise ConfigError(f"quantization_config.expert_dtype: only 'fp8' is supported "
                              f"(got {cfg.get('expert_dtype')!r})")
        static = scheme == "static"
        if "weight_block_size" not in cfg:
            self.scheme = Fp8Scheme(True, None, static, "weight_scale", "input_scale")
            return
        block = cfg["weight_block_size"]
        if block is not None:
            if (not isinstance(block, (list, tuple)) or len(block) != 2
                    or not all(isinstance(b, int) and b > 0 for b in block)):
                raise ConfigError(f"quantization_config.weight_block_size: must be two positive integers or null "
                                  f"(got {block!r})")
            block = (int(block[0]), int(block[1]))
        self.scheme = Fp8Scheme(True, block, static, "weight_scale_inv", "activation_scale")

    def validate(self, platform, dtype: torch.dtype) -> list[str]:
        return super().validate(platform, dtype) + fp8_reasons(self, platform)

    def quantizes(self, prefix: str) -> bool:
        return not layer_matches(prefix, self.skip, "ignored_layers")

    def expert_fp8_scheme(self, prefix):
        if self.scheme.static:
            raise ConfigError(f"quantization_config.activation_scheme: 'static' activation scales are not supported "
                              f"for mixture-of-experts layers ({prefix}); use a checkpoint with 'dynamic'")
        return self.scheme

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        self.scheme.create_weights(layer, input_size, output_sizes, params_dtype)

    def process_weights_after_loading(self, layer):
        self.scheme.process_weights_after_loading(layer)

    def apply(self, layer, x, bias):
        return self.scheme.apply(layer, x, bias)

    def apply_gated(self, layer, x, bias, activation):
        return self.scheme.apply_gated(layer, x, bias, activation)
