"""The ``toy`` platform: a pretend accelerator whose memory is a fixed 2 GiB on the host."""

from __future__ import annotations

import torch

from dovetail.platform import Platform
from acme_dovetail.probe import probe as _probe

_TOY_MEMORY = 2 * 1024**3


class ToyPlatform(Platform):
    """A toy accelerator: tensors live on the CPU, memory is a fixed budget, attention is TOY_ATTN."""

    name = "toy"
    device_type = "cpu"
    dist_backend = "gloo"
    is_accelerator = False
    verification = "example plugin; runs on the CPU in Dovetail's CI"

    @classmethod
    def probe(cls):
        return _probe()

    def device_count(self) -> int:
        return 1

    def memory_total(self, index: int = 0) -> int:
        return _TOY_MEMORY

    def memory_free(self, index: int = 0) -> int:
        return _TOY_MEMORY

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32]

    def default_attention_backends(self) -> list[str]:
        return ["TOY_ATTN", "REFERENCE"]

    def check_and_update_config(self, config) -> None:
        config.device.enforce_eager = True

    def kv_cache_bytes(self, config, profile) -> int:
        return config.cache.kv_cache_memory_bytes or 64 * 1024**2
