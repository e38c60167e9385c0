"""The KV-cache write shared by the CUDA backends: the core's Triton kernel on the GPU, else plain torch.

Both backends keep the core's default cache layout ``[2, blocks, block_size,
kv_heads, head_size]``, whose two halves are the ``NHD`` paged caches FlashInfer
and FlashAttention read. The Triton kernel skips negative slots without a host
synchronisation; the torch fallback (a CPU tensor, or a torch without triton)
is REFERENCE's.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from dovetail.attention.reference import write_kv_cache as torch_write


@lru_cache(maxsize=1)
def _triton_write():
    from dovetail.triton import triton_missing_reason

    if triton_missing_reason() is not None:
        return None
    from dovetail.triton.kv_cache_write import write_kv_cache

    return write_kv_cache


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k``, ``v`` at ``slot_mapping`` (negative: skip) in ``kv_cache``."""
    triton_write = _triton_write() if kv_cache.device.type != "cpu" else None
    (triton_write or torch_write)(k, v, kv_cache, slot_mapping)
