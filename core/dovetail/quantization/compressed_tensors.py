"""compressed-tensors checkpoints (llm-compressor): the W8A8 FP8 and INT8 schemes.

``quantization_config`` has ``quant_method: "compressed-tensors"``, a ``format``
(``float-quantized`` for FP8, ``int-quantized`` for INT8, or ``naive-quantized``),
``config_groups`` mapping a group name to ``{targets, weights, input_activations}``,
and an ``ignore`` list. A linear layer takes the first group whose targets name it
(``"Linear"``, a module name, or ``re:REGEX``) unless ``ignore`` names it.

Tensors per quantized layer: ``weight`` (float8_e4m3fn or int8 ``[N, K]``),
``weight_scale`` (``[1]`` per tensor, ``[N, 1]`` per channel, ``[ceil(N/bn), ceil(K/bk)]``
per block) and, for static activations, ``input_scale`` (``[1]``). Symmetric
schemes store no zero points.

Supported: weights of 8 bits, symmetric, ``float`` (strategies tensor, channel,
block) or ``int`` (tensor, channel); activations of the same type, dynamic per
token (per token group of ``bk`` features with FP8 blocks) or static per tensor
(symmetric). Anything else is refused naming the field.
"""

from __future__ import annotations

from typing import Any

from dovetail.errors import ConfigError, ModelLoadError
from dovetail.quantization.base import QuantMethod
from dovetail.quantization.fp8 import Fp8Scheme, fp8_reasons
from dovetail.quantization.int8 import Int8Scheme
from dovetail.quantization.matching import checkpoint_modules, layer_matches, name_matches

FORMATS = {"float-quantized": "float", "int-quantized": "int", "naive-quantized": None}


class CompressedTensorsMethod(QuantMethod):
    """compressed-tensors W8A8 checkpoints (FP8 or INT8), dispatched per layer by ``config_groups``."""

    name = "compressed-tensors"
    supported_platforms = ("*",)
    supported_act_dtypes = ("float32", "float16", "bfloat16")

    def __init__(self, config: dict[str, Any] | None = None):
        super().__init__(config)
        cfg = self.config
        self.pre_quantized = bool(cfg)
        self.ignore = list(cfg.get("ignore") or [])
        self.groups: list[tuple[str, list[str], Any]] = []
        if not cfg:
            return
        for key in ("kv_cache_scheme", "transform_config"):
            if cfg.get(key):
                raise ConfigError(f"quantization_config.{key}: not supported")
        sparsity = cfg.get("sparsity_config") or {}
        if sparsity and sparsity.get("format", "dense") != "dense":
            raise ConfigError(f"quantization_config.sparsity_config: sparse format {sparsity.get('format')!r} "
                              "is not supported")
        status = cfg.get("quantization_status", "compressed")
        if status != "compressed":
            raise ConfigError(f"quantization_config.quantization_status: only 'compressed' checkpoints are "
                              f"supported (got {status!r})")
        groups = cfg.get("config_groups") or {}
        if not isinstance(groups, dict) or not groups:
            raise ConfigError("quantization_config.config_groups: must map group names to schemes")
        for name, group in groups.items():
            where = f"quantization_config.config_groups.{name}"
            if not isinstance(group, dict) or not group.get("targets"):
                raise ConfigError(f"{where}: must be a scheme with 'targets' (got {group!r})")
            fmt = group.get("format") or cfg.get("format")
            self.groups.append((name, list(group["targets"]), _scheme(where, group, fmt)))
        self.uses_fp8 = any(isinstance(scheme, Fp8Scheme) for _, _, scheme in self.groups)

    def validate(self, platform, dtype):
        reasons = super().validate(platform, dtype)
        if not self.pre_quantized:
            reasons.append("quantization 'compressed-tensors' reads compressed-tensors checkpoints (config.json "
                           "quantization_config.quant_method 'compressed-tensors') and cannot quantize weights "
                           "at load; fp8 and int8 can")
        elif self.uses_fp8:
            reasons += fp8_reasons(self, platform)
        return reasons

    def quantizes(self, prefix: str) -> bool:
        return not layer_matches(prefix, self.ignore, "ignore") and self._group(prefix) is not None

    def _group(self, prefix: str):
        chosen = {}
        for module in checkpoint_modules(prefix):
            chosen[module] = next((g for g in self.groups if any(_targets(module, t) for t in g[1])), None)
        found = {id(g) for g in chosen.values()}
        if len(found) > 1:
            names = ", ".join(f"{m}: {g[0] if g else 'none'}" for m, g in chosen.items())
            raise ModelLoadError(f"quantization_config.config_groups quantize the modules Dovetail merges into "
                                 f"{prefix} differently ({names})")
        return next(iter(chosen.values()))

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        layer.ct_scheme = self._group(layer.prefix)[2]
        layer.ct_scheme.create_weights(layer, input_size, output_sizes, params_dtype)

    def process_weights_after_loading(self, layer):
        layer.ct_scheme.process_weights_after_loading(layer)

    def apply(self, layer, x, bias):
        return layer.ct_scheme.apply(layer, x, bias)


def _targets(module: str, target: str) -> bool:
    return target == "Linear" or name_matches(module, target)


def _scheme(where: str, group: dict, fmt: str | None):
    weights, acts = group.get("weights"), group.get("input_activations")
    if group.get("output_activations"):
        raise ConfigError(f"{where}.output_activations: output quantization is not supported")
    if not weights:
        raise ConfigError(f"{where}.weights: activation-only quantization is not supported")
    kind = weights.get("type")
    if weights.get("num_bits") != 8 or kind not in ("float", "int"):
        raise ConfigError(f"{where}.weights: {weights.get('num_bits')}-bit {kind} weights are not supported "
                          "(supported: 8-bit float (FP8) or int (INT8) weights with 8-bit activations)")
    if fmt not in FORMATS or FORMATS[fmt] not in (None, kind):
        raise ConfigError(f"{where}: format {fmt!r} does not hold 8-bit {kind} weights "
                          f"(supported: {', '.join(f for f, k in FORMATS.items() if k in (None, kind))})")
    if not weights.get("symmetric", True) or weights.get("actorder"):
        raise ConfigError(f"{where}.weights: only symmetric weights without actorder are supported")
    strategy = weights.get("strategy")
    allowed = ("tensor", "channel", "block") if kind == "float" else ("tensor", "channel")
    if strategy not in allowed:
        raise ConfigError(f"{where}.weights.strategy: {strategy!r} is not supported for {kind} weights "
                          f"(supported: {', '.join(allowed)})")
    block = None
    if strategy == "block":
        structure = weights.get("block_structure")
        if not (isinstance(structure, list) and len(structure) == 2 and all(isinstance(b, int) and b > 0
                                                                             for b in structure)):
            raise ConfigError(f"{where}.weights.block_structure: must be two positive integers (got {structure!r})")
        block = (structure[0], structure[1])
    static = _activations(where, acts, kind, block)
    if kind == "float":
        return Fp8Scheme(True, block, static, "weight_scale", "input_scale")
    return Int8Scheme(True, static)


def _activations(where: str, acts: dict | None, kind: str, block) -> bool:
    """True for static (per-tensor) activation scales, False for dynamic; refuses the rest."""
    if not acts:
        raise ConfigError(f"{where}.input_activations: weight-only (W8A16) schemes are not supported")
    if acts.get("type") != kind or acts.get("num_bits") != 8 or not acts.get("symmetric", True):
        raise ConfigError(f"{where}.input_activations: must be symmetric 8-bit {kind} like the weights "
                          f"(got {acts.get('num_bits')}-bit {acts.get('type')}, symmetric={acts.get('symmetric')})")
    strategy, dynamic = acts.get("strategy"), acts.get("dynamic")
    if strategy == "tensor" and dynamic is False:
        return True
    if block is None and strategy == "token" and dynamic is True:
        return False
    if block is not None and strategy == "group" and dynamic is True and acts.get("group_size") == block[1]:
        return False
    expected = (f"dynamic 'group' with group_size {block[1]}" if block else "dynamic 'token'")
    raise ConfigError(f"{where}.input_activations: strategy {strategy!r} with dynamic={dynamic!r} is not "
                      f"supported (supported: static 'tensor', or {expected})")
