"""LoRA adapters served beside their base model (vLLM's ``enable_lora``): see :class:`LoRARequest`."""

from dovetail.lora.request import LoRARequest

__all__ = ["LoRARequest"]
