"""A model's LoRA slots on one rank, and the adapters read for them (vLLM's LoRA model manager).

Every linear layer gets ``max_loras`` slots (:class:`~dovetail.lora.layer.LinearLoRA`). An adapter is
first read (:meth:`ModelLoRA.add`: its file checked against the model, this rank's share kept in host
memory), then put in a slot when a request that uses it arrives (:meth:`ModelLoRA.activate`), evicting the
adapter least recently used by no running request. Every rank sees the same requests in the same order,
so every rank puts each adapter in the same slot.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch
from torch import nn

from dovetail.errors import DovetailError, RequestError
from dovetail.layers.linear import Linear
from dovetail.layers.weights import WeightMapper
from dovetail.lora.adapter import LoRAWeights, read_adapter
from dovetail.lora.layer import LinearLoRA
from dovetail.lora.request import LoRARequest

#: (layer's slots, merged part, this rank's share of the update)
Placement = tuple[LinearLoRA, int, LoRAWeights]


class ModelLoRA:
    """The LoRA slots of ``model``'s linear layers, the adapters read for them, and which slot holds which."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.mapper = WeightMapper(model, rename=getattr(model, "rename_weights", ()))
        self.layers: list[LinearLoRA] = []
        for module in model.modules():
            if isinstance(module, Linear):
                module.lora = LinearLoRA(module, max_loras, max_lora_rank, dtype, device)
                self.layers.append(module.lora)
        self.adapters: dict[int, list[Placement]] = {}
        #: Adapter id -> slot, the least recently activated first.
        self.slot_of: OrderedDict[int, int] = OrderedDict()

    def add(self, request: LoRARequest) -> str | None:
        """Read ``request``'s adapter and keep this rank's share of it; the error's text if it cannot run
        (a worker must not raise for one request's bad adapter)."""
        if request.lora_int_id in self.adapters:
            return None
        try:
            weights = read_adapter(request.lora_path)
            self.adapters[request.lora_int_id] = [p for module, w in weights.items()
                                                  for p in self._placements(request.lora_path, module, w)]
        except DovetailError as exc:
            return str(exc)
        return None

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter's weights (a slot holding it keeps it until the slot is reused)."""
        self.adapters.pop(lora_int_id, None)

    def activate(self, lora_int_id: int, in_use: Callable[[], set[int]]) -> int:
        """The slot holding the adapter, loading it there first if needed; the adapters in ``in_use()`` (those of
        the running requests, asked only when every slot is taken) keep theirs."""
        if lora_int_id in self.slot_of:
            self.slot_of.move_to_end(lora_int_id)
            return self.slot_of[lora_int_id]
        placements = self.adapters.get(lora_int_id)
        if placements is None:
            raise RuntimeError(f"LoRA adapter {lora_int_id} was not added before a request used it")
        taken = set(self.slot_of.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:
            busy = in_use()
            victim = next((i for i in self.slot_of if i not in busy), None)
            if victim is None:
                raise RuntimeError(f"all {self.max_loras} LoRA slots hold adapters of running requests")
            slot = self.slot_of.pop(victim)
        for layer in self.layers:
            layer.clear(slot)
        for layer, part, weights in placements:
            layer.load(slot, part, weights)
        self.slot_of[lora_int_id] = slot
        return slot

    def _placements(self, path: str, module: str, weights: LoRAWeights) -> list[Placement]:
        """Where ``module``'s update goes on this rank: its layer's slots, the merged part, its share."""
        def refuse(message: str) -> RequestError:
            return RequestError(f"lora_request: the adapter at {path!r} changes {module!r}, {message}",
                                field="lora_request")

        target = self.mapper.linear_target(module)
        if target is None:
            raise refuse("which is not a linear layer of this model that takes LoRA")
        linear, shard = target
        if weights.rank > self.max_lora_rank:
            raise refuse(f"with rank {weights.rank}, above max_lora_rank={self.max_lora_rank}")
        if weights.a.shape[1] != linear.total_input_size:
            raise refuse(f"with lora_A of {weights.a.shape[1]} inputs; the layer has {linear.total_input_size}")
        a = weights.a
        if not linear.input_part.whole:
            start, length = linear.input_part.of(a.shape[1], f"lora_A of {module!r}")
            a = a.narrow(1, start, length)
        parts = range(len(linear.output_sizes)) if shard is None else [shard]
        expected = sum(linear.total_output_sizes[p] for p in parts)
        if weights.b.shape[0] != expected:
            raise refuse(f"with lora_B of {weights.b.shape[0]} outputs; the layer has {expected}")
        placements, row = [], 0
        for part in parts:
            total = linear.total_output_sizes[part]
            b = weights.b.narrow(0, row, total)
            row += total
            if not linear.output_parts[part].whole:
                start, length = linear.output_parts[part].of(total, f"lora_B of {module!r}")
                b = b.narrow(0, start, length)
            placements.append((linear.lora, part, LoRAWeights(a.contiguous(), b.contiguous(), weights.scale)))
        return placements
