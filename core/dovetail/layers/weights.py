"""Mapping checkpoint tensors onto a model's parameters, merged projections and stacked experts included."""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from dovetail.checkpoint_tensor import read
from dovetail.errors import ModelLoadError
from dovetail.layers.linear import Linear
from dovetail.layers.moe import FusedMoE

#: (parameter part, checkpoint part, shard index): the merged projections of most models.
DEFAULT_STACKED = (
    (".qkv_proj.", ".q_proj.", 0),
    (".qkv_proj.", ".k_proj.", 1),
    (".qkv_proj.", ".v_proj.", 2),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)

#: Per-expert checkpoint projection -> (:class:`FusedMoE` parameter, shard): HF's names and Mixtral's.
DEFAULT_EXPERT_PROJECTIONS = {
    "gate_proj": ("w13_weight", 0), "up_proj": ("w13_weight", 1), "down_proj": ("w2_weight", None),
    "w1": ("w13_weight", 0), "w3": ("w13_weight", 1), "w2": ("w2_weight", None),
}
#: transformers 5's own layout: every expert in one tensor.
STACKED_EXPERT_TENSORS = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}

_PER_EXPERT = re.compile(r"^(?P<module>(?:.+\.)?experts)\.(?P<expert>\d+)\.(?P<proj>\w+)"
                         r"\.weight(?P<scale>_scale(?:_inv)?)?$")
_ALL_EXPERTS = re.compile(r"^(?P<module>(?:.+\.)?experts)\.(?P<proj>gate_up_proj|down_proj)$")


class WeightMapper:
    """Loads ``(name, tensor)`` pairs into ``model`` and reports what was filled.

    A tensor may be a :class:`~dovetail.checkpoint_tensor.CheckpointTensor` (under tensor
    parallelism): each layer reads only its rank's part of it.

    - ``stacked``: checkpoint name parts that load as a shard of a merged parameter.
    - ``ignore``: regular expressions of checkpoint names to skip (e.g. rotary buffers).
    - ``rename``: ``(pattern, replacement)`` regex substitutions applied first.
    - ``expert_projections``: per-expert checkpoint names (``...experts.<e>.<name>.weight``)
      and the :class:`FusedMoE` parameter and shard each fills.
    """

    def __init__(self, model: nn.Module, stacked=DEFAULT_STACKED, ignore: Iterable[str] = (),
                 rename: Iterable[tuple[str, str]] = (), expert_projections=None):
        self.model = model
        self.stacked = tuple(stacked)
        self.expert_projections = dict(DEFAULT_EXPERT_PROJECTIONS if expert_projections is None
                                       else expert_projections)
        self.moe_layers = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}
        self.ignore = [re.compile(p) for p in (r"rotary_emb\.inv_freq$", *ignore)]
        self.rename = [(re.compile(p), r) for p, r in rename]
        self.params: dict[str, tuple[nn.Module, nn.Parameter]] = {}
        self._modules: dict[str, nn.Module] | None = None  # by name, once ``linear_target`` needs them
        for module_name, module in model.named_modules():
            for pname, param in module.named_parameters(recurse=False):
                full = f"{module_name}.{pname}" if module_name else pname
                self.params.setdefault(full, (module, param))

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        shards: dict[str, set[int]] = {}
        for name, tensor in weights:
            for pattern, replacement in self.rename:
                name = pattern.sub(replacement, name)
            if any(p.search(name) for p in self.ignore):
                continue
            if self.moe_layers:
                done = self._load_experts(name, tensor)
                if done is not None:
                    loaded.update(done)
                    continue
            target, shard = self._target(name)
            if target is None:
                raise ModelLoadError(f"unexpected tensor {name!r} in the checkpoint: the model "
                                     f"({type(self.model).__name__}) has no parameter for it")
            module, param = self.params[target]
            if isinstance(module, Linear):
                module.load_shard(param, tensor, shard, name)
            elif getattr(param, "weight_loader", None) is not None:
                param.weight_loader(param, tensor, shard)
            else:
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, but parameter "
                                         f"{target!r} expects {tuple(param.shape)}")
                param.data.copy_(read(tensor))
            if shard is None:
                loaded.add(target)
            else:
                got = shards.setdefault(target, set())
                got.add(shard)
                if len(got) == len(module.output_sizes):
                    loaded.add(target)
        return loaded

    def _load_experts(self, name: str, tensor: torch.Tensor) -> set[str] | None:
        """Load an expert tensor into its :class:`FusedMoE`; None when ``name`` is not one."""
        match = _PER_EXPERT.match(name)
        if match and match["module"] in self.moe_layers:
            layer = self.moe_layers[match["module"]]
            if match["proj"] not in self.expert_projections:
                known = ", ".join(sorted(self.expert_projections))
                raise ModelLoadError(f"unexpected tensor {name!r} in the checkpoint: expert projection "
                                     f"{match['proj']!r} is not one of {known}")
            param, shard = self.expert_projections[match["proj"]]
            if match["scale"]:  # an FP8 checkpoint's weight_scale / weight_scale_inv
                param = f"{param}_scale"
            complete = layer.load_expert(param, tensor, int(match["expert"]), shard, name)
            return {f"{match['module']}.{param}"} if complete else set()
        match = _ALL_EXPERTS.match(name)
        if match and match["module"] in self.moe_layers:
            param = STACKED_EXPERT_TENSORS[match["proj"]]
            self.moe_layers[match["module"]].load_stacked(param, tensor, name)
            return {f"{match['module']}.{param}"}
        return None

    def linear_target(self, module: str) -> tuple[Linear, int | None] | None:
        """The linear layer that the checkpoint's module ``module`` (``model.layers.0.self_attn.q_proj``, renamed
        as when loading) is part of, and its merged part (None: the whole layer); None when no linear layer is.
        Its tensors may be any the layer's quantization method reads."""
        name = f"{module}."
        for pattern, replacement in self.rename:
            name = pattern.sub(replacement, name)
        if self._modules is None:
            self._modules = dict(self.model.named_modules())
        modules = self._modules
        for param_part, ckpt_part, shard in self.stacked:
            candidate = modules.get(name.replace(ckpt_part, param_part).rstrip(".")) if ckpt_part in name else None
            if isinstance(candidate, Linear):
                return candidate, shard
        found = modules.get(name.rstrip("."))
        return (found, None) if isinstance(found, Linear) else None

    def _target(self, name: str) -> tuple[str | None, int | None]:
        for param_part, ckpt_part, shard in self.stacked:
            if ckpt_part in name:
                candidate = name.replace(ckpt_part, param_part)
                if candidate in self.params:
                    return candidate, shard
        if name in self.params:
            return name, None
        return None, None
