"""The engine's book of LoRA adapters the workers have read (vLLM's CPU LoRA cache, ``max_cpu_loras``).

An adapter is read by every rank when a request first names it (an adapter that cannot run is refused
then, with that request, naming ``lora_request``); beyond ``max_cpu_loras`` the adapters least recently
named by a request, and used by no unfinished one, are forgotten, and read again when named again. An id
names one folder for the engine's life, forgotten or not: a slot and the prefix cache know an adapter by
its id.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from dovetail.errors import RequestError
from dovetail.lora.request import LoRARequest


class AdapterRegistry:
    """Which adapters the workers hold; ``call(method, *args)`` runs a method on every worker."""

    def __init__(self, call: Callable[..., list], max_cpu_loras: int):
        self.call = call
        self.max_cpu_loras = max_cpu_loras
        self.adapters: OrderedDict[int, LoRARequest] = OrderedDict()
        #: Every id ever read, and its adapter.
        self.named: dict[int, LoRARequest] = {}

    def ensure(self, request: LoRARequest, in_use: Callable[[], set[int]]) -> None:
        """Have every worker hold ``request``'s adapter, or raise :class:`RequestError` with the reason;
        ``in_use()`` gives the ids of the unfinished requests' adapters, asked only when one is to be forgotten."""
        known = self.named.get(request.lora_int_id)
        if known is not None and known.lora_path != request.lora_path:
            raise RequestError(f"lora_request.lora_int_id: {request.lora_int_id} already names the adapter at "
                               f"{known.lora_path!r} ({known.lora_name!r}); give {request.lora_path!r} another id",
                               field="lora_request")
        if request.lora_int_id in self.adapters:
            self.adapters.move_to_end(request.lora_int_id)
            return
        errors = [e for e in self.call("add_lora", request) if e]
        if errors:
            raise RequestError(errors[0], field="lora_request")
        self.adapters[request.lora_int_id] = self.named[request.lora_int_id] = request
        excess = len(self.adapters) - self.max_cpu_loras
        if excess <= 0:
            return
        busy = in_use() | {request.lora_int_id}
        for lora_id in [i for i in self.adapters if i not in busy][:excess]:
            del self.adapters[lora_id]
            self.call("remove_lora", lora_id)
