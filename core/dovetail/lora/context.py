"""The step's adapter of each token, as the LoRA layers read it.

The model runner sets a ``[tokens, max_loras]`` one-hot mask around each forward of a model with LoRA
slots (row ``t`` is 1 in the slot of token ``t``'s adapter, all 0 for the base model), so the layers need
nothing in their signatures and a device graph reads the mask from a static buffer.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch

_mask: Optional[torch.Tensor] = None


def slot_mask() -> torch.Tensor:
    if _mask is None:
        raise RuntimeError("no LoRA slot mask: a model with LoRA slots must run inside the runner's lora_slots")
    return _mask


@contextmanager
def lora_slots(mask: Optional[torch.Tensor]) -> Iterator[None]:
    """Run the forward inside with ``mask`` (None: the model has no LoRA slots)."""
    global _mask
    previous, _mask = _mask, mask
    try:
        yield
    finally:
        _mask = previous


def slot_mask_of(token_slots: torch.Tensor, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
    """The one-hot mask ``[tokens, num_slots]`` of each token's slot (``-1``: the base model) on their device."""
    hot = torch.nn.functional.one_hot(token_slots.long() + 1, num_slots + 1)
    return hot[:, 1:].to(dtype)
