"""Mapping checkpoint tensors onto a model's parameters, merged projections included."""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from dovetail.errors import ModelLoadError
from dovetail.layers.linear import Linear

#: (parameter part, checkpoint part, shard index): the merged projections of most models.
DEFAULT_STACKED = (
    (".qkv_proj.", ".q_proj.", 0),
    (".qkv_proj.", ".k_proj.", 1),
    (".qkv_proj.", ".v_proj.", 2),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)


class WeightMapper:
    """Loads ``(name, tensor)`` pairs into ``model`` and reports what was filled.

    - ``stacked``: checkpoint name parts that load as a shard of a merged parameter.
    - ``ignore``: regular expressions of checkpoint names to skip (e.g. rotary buffers).
    - ``rename``: ``(pattern, replacement)`` regex substitutions applied first.
    """

    def __init__(self, model: nn.Module, stacked=DEFAULT_STACKED, ignore: Iterable[str] = (),
                 rename: Iterable[tuple[str, str]] = ()):
        self.model = model
        self.stacked = tuple(stacked)
        self.ignore = [re.compile(p) for p in (r"rotary_emb\.inv_freq$", *ignore)]
        self.rename = [(re.compile(p), r) for p, r in rename]
        self.params: dict[str, tuple[nn.Module, nn.Parameter]] = {}
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
            target, shard = self._target(name)
            if target is None:
                raise ModelLoadError(f"unexpected tensor {name!r} in the checkpoint: the model "
                                     f"({type(self.model).__name__}) has no parameter for it")
            module, param = self.params[target]
            if isinstance(module, Linear):
                module.load_shard(param, tensor, shard, name)
            else:
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, but parameter "
                                         f"{target!r} expects {tuple(param.shape)}")
                param.data.copy_(tensor)
            if shard is None:
                loaded.add(target)
            else:
                got = shards.setdefault(target, set())
                got.add(shard)
                if len(got) == len(module.output_sizes):
                    loaded.add(target)
        return loaded

    def _target(self, name: str) -> tuple[str | None, int | None]:
        for param_part, ckpt_part, shard in self.stacked:
            if ckpt_part in name:
                candidate = name.replace(ckpt_part, param_part)
                if candidate in self.params:
                    return candidate, shard
        if name in self.params:
            return name, None
        return None, None
