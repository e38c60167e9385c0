"""Which LoRA adapter a request runs with (vLLM's ``LoRARequest``)."""

from __future__ import annotations

from dataclasses import dataclass

from dovetail.errors import RequestError


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter for a request: ``LoRARequest("sql", 1, "/adapters/sql")``.

    ``lora_int_id`` (1 or more) identifies the adapter inside the engine: requests with the same id share
    its loaded weights and their cached prefixes, so one id must always name the same adapter.
    ``lora_path`` is the folder PEFT's ``save_pretrained`` wrote (``adapter_config.json`` and
    ``adapter_model.safetensors``).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise RequestError(f"lora_request.lora_int_id: must be an integer of at least 1 (got "
                               f"{self.lora_int_id!r})", field="lora_request")
        if not self.lora_name or not isinstance(self.lora_name, str):
            raise RequestError("lora_request.lora_name: must be a non-empty string", field="lora_request")
        if not self.lora_path or not isinstance(self.lora_path, str):
            raise RequestError("lora_request.lora_path: must name the adapter's folder", field="lora_request")
