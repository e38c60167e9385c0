"""The QuantMethod contract: how a quantization scheme creates, loads and applies linear weights.

A method is registered by name (``register_quantization_methods``), chosen with
``--quantization NAME`` or detected from a checkpoint's ``quantization_config``
(its ``quant_method`` is the name), and applied through the linear layers' hook:
every :class:`dovetail.layers.linear.Linear` asks the model's method to create
its parameters, to post-process them after loading, and to compute ``x @ W.T + b``.

Parameters a method creates carry two attributes the loader reads:

- ``output_dim``: the dimension that indexes output features (``None`` when the
  tensor has none, e.g. GPTQ's ``g_idx``). Merged layers (QKV, gate/up) place
  each checkpoint shard along it, at ``offset * param.shape[output_dim] // total``.
- ``input_dim`` (optional): the dimension that indexes input features (``None``
  or absent when it has none, e.g. a per-channel scale).

  Under tensor parallelism a column-parallel layer gives each rank its part of
  every checkpoint tensor along ``output_dim``, a row-parallel layer along
  ``input_dim`` (equal parts, so packed or blocked dimensions split in
  proportion); a dimension of size 1 is a broadcast value and stays whole.
  ``create_weights`` receives this rank's sizes; the layer's ``input_part`` and
  ``output_parts`` say how it is split, ``total_input_size`` and
  ``total_output_sizes`` give the checkpoint's sizes.
- ``weight_loader`` (optional): ``fn(param, tensor, shard_index)`` replacing
  the default placement; ``tensor`` is already this rank's part.
- ``load_optional`` (optional): True when the checkpoint may lack the tensor
  (e.g. a scale a method computes itself when it quantizes a float checkpoint).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from dovetail.platform import Platform


class QuantMethod(ABC):
    """A quantization scheme for linear layers.

    - ``name``: the flag value and checkpoint ``quant_method``.
    - ``supported_platforms``: platform names it runs on (``"*"``: all).
    - ``supported_act_dtypes``: activation dtypes names (``"bfloat16"``, ...).

    One instance is built per model, from the checkpoint's
    ``quantization_config`` (or ``{}`` when only the flag asked for it).
    """

    name: ClassVar[str]
    supported_platforms: ClassVar[tuple[str, ...]] = ("*",)
    supported_act_dtypes: ClassVar[tuple[str, ...]] = ("float32", "float16", "bfloat16")
    #: True for methods that only read checkpoints their tool quantized (they cannot quantize at load).
    checkpoint_only: ClassVar[bool] = False

    def __init__(self, config: dict[str, Any] | None = None):
        self.config = dict(config or {})

    @classmethod
    def from_config(cls, hf_quant_config: dict[str, Any] | None) -> "QuantMethod":
        """Build from a checkpoint's ``quantization_config`` (``None``: from the flag alone)."""
        return cls(hf_quant_config)

    def validate(self, platform: "Platform", dtype: torch.dtype) -> list[str]:
        """Reasons this method cannot run on ``platform`` with activations in ``dtype``."""
        reasons = []
        if "*" not in self.supported_platforms and platform.name not in self.supported_platforms:
            reasons.append(f"quantization {self.name!r} does not run on platform {platform.name!r} "
                           f"(runs on: {', '.join(self.supported_platforms)})")
        dtype_name = str(dtype).removeprefix("torch.")
        if dtype_name not in self.supported_act_dtypes:
            reasons.append(f"quantization {self.name!r} does not support activation dtype {dtype_name} "
                           f"(supported: {', '.join(self.supported_act_dtypes)})")
        if self.checkpoint_only and not self.config:
            reasons.append(f"quantization {self.name!r} reads {self.name.upper()} checkpoints (config.json "
                           f"quantization_config.quant_method {self.name!r}) and cannot quantize weights at load; "
                           "fp8 and int8 can")
        return reasons

    def quantizes(self, prefix: str) -> bool:
        """Whether the linear layer at ``prefix`` is quantized (False leaves it in float)."""
        return True

    @abstractmethod
    def create_weights(self, layer: torch.nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        """Register the layer's parameters (e.g. ``weight``, ``weight_scale``) on ``layer``."""

    @abstractmethod
    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Compute ``x @ W.T + bias`` for ``x`` of shape ``[tokens, input_size]``."""

    def apply_gated(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                    activation: str) -> torch.Tensor | None:
        """``act(y[:, :N/2]) * y[:, N/2:]`` for ``y = apply(layer, x, bias)`` in one kernel, or None where the
        method has none (the layer then runs :meth:`apply` and its activation module)."""
        return None

    def expert_fp8_scheme(self, prefix: str):
        """How the mixture-of-experts weights at ``prefix`` are stored when this method quantizes them: an
        :class:`dovetail.quantization.fp8.Fp8Scheme` (FP8 experts), or None where the method cannot quantize
        experts (the model is then refused, naming the layer)."""
        return None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack or quantize the loaded weights (once, after every tensor is loaded)."""
