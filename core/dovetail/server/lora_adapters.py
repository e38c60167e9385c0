"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (vLLM's): LoRA adapters served or
withdrawn while the server runs.

They are offered only by a server with ``--enable-lora`` started with ``DOVETAIL_ALLOW_RUNTIME_LORA_UPDATING``
set to true (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): whoever may call them can make the server read any
folder it can see. A loaded adapter is read by every rank before the answer (an adapter that cannot run is a
400 naming ``lora_path``). An unloaded one is no longer served; requests already running with it finish.
"""

from __future__ import annotations

import os

from fastapi import Request
from fastapi.responses import PlainTextResponse

from dovetail.errors import RequestError
from dovetail.lora.request import LoRARequest
from dovetail.server.errors import APIError
from dovetail.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from dovetail.server.state import ServerState

RUNTIME_UPDATING_ENV = "DOVETAIL_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed(lora_enabled: bool, environ=os.environ) -> bool:
    """Whether the server offers the two endpoints: LoRA enabled and the variable set to true (``1``, ``yes``)."""
    return lora_enabled and environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true", "yes")


def _check_new_name(state: ServerState, name: str) -> None:
    if name in state.settings.lora_modules or name in state.settings.served_model_names:
        raise RequestError(f"lora_name: {name!r} is already served", field="lora_name")


async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    state: ServerState = request.app.state.server
    _check_new_name(state, body.lora_name)
    lora = LoRARequest(body.lora_name, state.next_lora_id(), body.lora_path)
    try:
        await state.engine.call(lambda engine: engine.add_lora(lora))
    except RequestError as exc:
        message = str(exc).removeprefix("lora_request: ").removeprefix("lora_request.lora_int_id: ")
        raise RequestError(f"lora_path: {message}", field="lora_path") from None
    _check_new_name(state, body.lora_name)  # another load of that name may have finished meanwhile
    state.settings.lora_modules[body.lora_name] = lora
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    state: ServerState = request.app.state.server
    if state.settings.lora_modules.pop(body.lora_name, None) is None:
        raise APIError(404, f"lora_name: no adapter named {body.lora_name!r} is served", param="lora_name",
                       code="model_not_found")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
