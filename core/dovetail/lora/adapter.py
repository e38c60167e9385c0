"""Reading a PEFT LoRA adapter: its ``adapter_config.json`` and its ``lora_A`` / ``lora_B`` weights.

An adapter changes a linear layer ``y = x W^T`` into ``y = x W^T + s (x A^T) B^T`` with ``A`` of shape
``[r, in]``, ``B`` of shape ``[out, r]`` and ``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
rsLoRA). What the engine cannot apply faithfully is refused with the reason: DoRA, trained biases,
whole modules saved beside the adapter (``modules_to_save``), embedding adapters, per-module rank or
alpha patterns, and ``fan_in_fan_out`` (GPT-2's transposed layers).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from dovetail.errors import RequestError

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
#: The prefix PEFT gives every tensor of a causal LM's adapter.
PEFT_PREFIX = "base_model.model."


@dataclass
class LoRAWeights:
    """One module's update: ``A`` ``[r, in]``, ``B`` ``[out, r]`` and the scale ``s``."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


def _error(path: str, message: str) -> RequestError:
    return RequestError(f"lora_request: the adapter at {path!r} {message}", field="lora_request")


def read_config(path: str) -> dict:
    """The adapter's ``adapter_config.json``, checked for what the engine can apply."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise _error(path, f"has no {CONFIG_FILE} (a folder written by PEFT's save_pretrained is expected)")
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise _error(path, f"has an unreadable {CONFIG_FILE}: {exc}") from None
    if not isinstance(config, dict):
        raise _error(path, f"has a {CONFIG_FILE} that is not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    refusals = [
        (peft_type != "LORA", f"is a {peft_type} adapter; only LORA adapters are supported"),
        (bool(config.get("use_dora")), "uses DoRA (use_dora), which is not supported"),
        (config.get("bias", "none") != "none", f"trains biases (bias={config.get('bias')!r}); only 'none' is "
                                               "supported"),
        (bool(config.get("modules_to_save")), f"saves whole modules beside the adapter (modules_to_save="
                                              f"{config.get('modules_to_save')!r}), which is not supported"),
        (bool(config.get("rank_pattern")) or bool(config.get("alpha_pattern")),
         "sets per-module ranks or alphas (rank_pattern, alpha_pattern), which are not supported"),
        (bool(config.get("fan_in_fan_out")), "stores transposed weights (fan_in_fan_out), which is not supported"),
    ]
    for refused, reason in refusals:
        if refused:
            raise _error(path, reason)
    for name in ("r", "lora_alpha"):
        value = config.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise _error(path, f"has {name}={value!r} in {CONFIG_FILE}; a positive number is needed")
    return config


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(file, device="cpu")
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # a damaged file: its reader's own words
            raise _error(path, f"has an unreadable {name}: {exc}") from None
    raise _error(path, f"has no weights ({' or '.join(WEIGHT_FILES)})")


def read_adapter(path: str) -> dict[str, LoRAWeights]:
    """Every module the adapter changes, by the base checkpoint's module name (``model.layers.0.self_attn.q_proj``),
    with the float32 weights and scale of its update."""
    config = read_config(path)
    tensors = _read_tensors(path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        module, _, kind = name.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise _error(path, f"holds tensor {name!r}, which is not a lora_A or lora_B weight (embedding "
                               "adapters and DoRA magnitudes are not supported)")
        pairs.setdefault(module, {})[kind[0]] = tensor
    if not pairs:
        raise _error(path, "holds no lora_A / lora_B weights")
    alpha = float(config["lora_alpha"])
    weights = {}
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            present = "A" if "A" in pair else "B"
            raise _error(path, f"has a lora_{present} weight for {module!r} without its pair")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise _error(path, f"has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} for {module!r}, which "
                               "do not make a product B @ A")
        rank = a.shape[0]
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        weights[module] = LoRAWeights(a.float(), b.float(), scale)
    return weights
