"""Dovetail's CUDA plugin: the ``cuda`` platform and the FLASHINFER and FLASH_ATTN backends."""
