"""The KV-cache write shared by the CUDA backends: the core's Triton kernel, else plain torch.

Both backends keep the core's default cache layout ``[2, blocks, block_size,
kv_heads, head_size]``, whose two halves are the ``NHD`` paged caches FlashInfer
and FlashAttention read. The Triton kernel skips negative slots without a host
synchronisation; the torch fallback (a torch without triton) is REFERENCE's.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def kv_cache_writer():
    """The function ``write(k, v, kv_cache, slot_mapping)`` to use in this process."""
    from dovetail.triton import triton_missing_reason

    if triton_missing_reason() is None:
        from dovetail.triton.kv_cache_write import write_kv_cache
    else:
        from dovetail.attention.reference import write_kv_cache
    return write_kv_cache
