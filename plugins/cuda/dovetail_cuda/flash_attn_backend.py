"""``FLASH_ATTN``: paged attention through the ``flash_attn`` package (FlashAttention 2 or 3).

One call per layer covers the whole mixed batch, as the packages document it:

- FlashAttention-3 (the ``flash_attn_interface`` module built from the
  repository's ``hopper/`` folder; used on sm_90): ``flash_attn_with_kvcache``
  with ``page_table`` (any block size), ``cache_seqlens``, and the packed
  queries described by ``cu_seqlens_q`` / ``max_seqlen_q``.
- FlashAttention-2 (``flash_attn`` >= 2.6): ``flash_attn_varlen_func`` with
  ``block_table``; its paged cache needs blocks of a multiple of 256 tokens.

Both take the ``NHD`` halves of the core's ``[2, blocks, block_size, kv_heads,
head_size]`` cache, align ``causal=True`` to the end of the keys, and keep keys
``[i + sk - sq - left, i + sk - sq]`` for ``window_size=(left, 0)``: a window
of ``w`` tokens is ``left = w - 1``.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

import torch

from dovetail.attention.backend import (AttentionBackend, AttentionImpl, AttentionMetadataBuilder,
                                        AttentionRequirements)
from dovetail.attention.batch import AttentionBatch
from dovetail_cuda.kv_write import write_kv_cache

#: FlashAttention-2 refuses paged caches whose block size is not a multiple of this.
FA2_BLOCK_MULTIPLE = 256

VERIFICATION = (
    "NOT verified on a GPU: neither flash-attn (FA2) nor FlashAttention-3 is installed on the H200 test "
    "machine, and neither could be built or carried there within the session, so no FlashAttention kernel "
    "ever ran. Implemented from the packages' documented signatures; tested on the CPU against a stand-in "
    "module that checks the arguments as documented and computes the documented semantics"
)


def fa3_installed() -> bool:
    return importlib.util.find_spec("flash_attn_interface") is not None


def fa2_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def use_fa3() -> bool:
    """FlashAttention-3 when it is installed and the current device is a Hopper GPU."""
    return fa3_installed() and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@dataclass
class FlashAttnMetadata:
    """The step's batch, plus the cumulative key lengths FlashAttention-2 wants."""

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_k: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int


class FlashAttnMetadataBuilder(AttentionMetadataBuilder):
    """Adds ``cu_seqlens_k``; for graphs it lives in a static buffer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.graph_cu_seqlens_k: torch.Tensor | None = None

    def build(self, batch: AttentionBatch) -> FlashAttnMetadata:
        cu_k = self._cu_seqlens_k(batch).to(self.device, non_blocking=True)
        return self._metadata(batch, cu_k)

    def build_for_graph(self, batch: AttentionBatch, graph_size: int) -> FlashAttnMetadata:
        if self.graph_cu_seqlens_k is None or self.graph_cu_seqlens_k.numel() < graph_size + 1:
            self.graph_cu_seqlens_k = torch.zeros(graph_size + 1, dtype=torch.int32, device=self.device)
        cu_k = self.graph_cu_seqlens_k[:graph_size + 1]
        cu_k.copy_(self._cu_seqlens_k(batch), non_blocking=True)
        return self._metadata(batch, cu_k)

    @staticmethod
    def _cu_seqlens_k(batch: AttentionBatch) -> torch.Tensor:
        cu = torch.zeros(batch.num_seqs + 1, dtype=torch.int32)
        torch.cumsum(batch.seq_lens_cpu, 0, out=cu[1:])
        return cu

    @staticmethod
    def _metadata(batch: AttentionBatch, cu_k: torch.Tensor) -> FlashAttnMetadata:
        return FlashAttnMetadata(batch.slot_mapping, batch.query_start_loc, batch.seq_lens, cu_k,
                                 batch.block_table, batch.max_query_len, batch.max_seq_len)


class FlashAttnImpl(AttentionImpl):
    """Writes the new keys and values, then one FlashAttention call over the mixed batch."""

    def __init__(self, spec):
        super().__init__(spec)
        self.fa3 = use_fa3()
        module = importlib.import_module("flash_attn_interface" if self.fa3 else "flash_attn")
        self.attend = module.flash_attn_with_kvcache if self.fa3 else module.flash_attn_varlen_func
        self.write = write_kv_cache
        self.window = (spec.sliding_window - 1, 0) if spec.sliding_window else (-1, -1)

    def forward(self, q, k, v, kv_cache, metadata: FlashAttnMetadata):
        self.write(k, v, kv_cache, metadata.slot_mapping)
        spec = self.spec
        options = dict(softmax_scale=spec.scale, causal=True, window_size=self.window,
                       softcap=spec.logit_softcap or 0.0)
        if self.fa3:
            return self.attend(q, kv_cache[0], kv_cache[1], cache_seqlens=metadata.seq_lens,
                               page_table=metadata.block_table, cu_seqlens_q=metadata.query_start_loc,
                               max_seqlen_q=metadata.max_query_len, **options)
        return self.attend(q, kv_cache[0], kv_cache[1], metadata.query_start_loc, metadata.cu_seqlens_k,
                           metadata.max_query_len, metadata.max_seq_len, block_table=metadata.block_table,
                           **options)


class FlashAttnBackend(AttentionBackend):
    """FlashAttention-3 on Hopper, else FlashAttention-2 (blocks of a multiple of 256 tokens)."""

    name = "FLASH_ATTN"
    verification = VERIFICATION
    supported_head_sizes = tuple(range(8, 257, 8))
    supported_dtypes = ("float16", "bfloat16")
    supported_kv_cache_dtypes = ("auto",)
    supported_block_sizes = None
    supports_sliding_window = True
    supports_logit_softcap = True
    supports_gqa = True
    supported_device_types = ("cuda",)
    supports_graph_capture = True

    @classmethod
    def available(cls) -> str | None:
        if not fa2_installed() and not fa3_installed():
            return ("the flash-attn package is not installed (pip install flash-attn; for FlashAttention-3 "
                    "on Hopper, build hopper/ of github.com/Dao-AILab/flash-attention)")
        return None

    @classmethod
    def validate(cls, req: AttentionRequirements) -> list[str]:
        reasons = super().validate(req)
        if cls.available() is None and not use_fa3():
            if not fa2_installed():
                reasons.append(f"FlashAttention-3 is installed but needs a Hopper (sm_90) GPU for {cls.name}")
            elif req.block_size % FA2_BLOCK_MULTIPLE:
                reasons.append(f"block size {req.block_size} not supported by {cls.name} with FlashAttention-2 "
                               f"(its paged cache needs a multiple of {FA2_BLOCK_MULTIPLE}: "
                               f"--block-size {FA2_BLOCK_MULTIPLE})")
        return reasons

    @classmethod
    def metadata_builder_cls(cls):
        return FlashAttnMetadataBuilder

    @classmethod
    def impl_cls(cls):
        return FlashAttnImpl
