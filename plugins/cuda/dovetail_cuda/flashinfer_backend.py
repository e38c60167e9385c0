"""``FLASHINFER``: paged attention through flashinfer-python (0.6.11) on NVIDIA GPUs.

Per step, the metadata builder plans FlashInfer's wrappers once and every layer
reuses the plan (layers that differ in window, soft-cap or scale get a plan of
their own):

- ``BatchDecodeWithPagedKVCacheWrapper`` with tensor-core kernels (they share
  the prefill's JIT build; on Hopper they matched the CUDA-core decode at
  batch 1 and beat it at batch 256) for the one-token decodes, which the batch
  puts first;
- ``BatchPrefillWithPagedKVCacheWrapper`` (``causal=True``, whose mask is
  aligned to the end of the keys) for prefills and chunked prefills.

The page table is FlashInfer's CSR form: ``paged_kv_indptr`` (``[seqs + 1]``),
``paged_kv_indices`` (each sequence's used blocks, concatenated) and
``paged_kv_last_page_len`` (tokens in each last block, 1..block_size). The cache
is the core's ``[2, blocks, block_size, kv_heads, head_size]``; its halves are
the ``NHD`` key and value caches passed as a tuple. A window of ``w`` tokens is
FlashInfer's ``window_left = w - 1``.

Decode graphs use one ``use_cuda_graph=True`` decode wrapper per captured batch
size, with fixed index buffers that each replay re-plans into.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dovetail.attention.backend import (AttentionBackend, AttentionImpl, AttentionLayerSpec,
                                        AttentionMetadataBuilder)
from dovetail.attention.batch import AttentionBatch
from dovetail.device_copy import to_device
from dovetail_cuda.kv_write import write_kv_cache

#: The float workspace FlashInfer's split-KV kernels use (the size vLLM gives it).
WORKSPACE_BYTES = 256 * 1024 * 1024
#: FlashInfer's prefill implementation: "fa2" shares its compiled module with the tensor-core
#: decode (one JIT build), "auto" picks FlashAttention-3-style kernels on Hopper.
PREFILL_BACKEND = os.environ.get("DOVETAIL_FLASHINFER_PREFILL_BACKEND", "fa2")


VERIFICATION = (
    "verified on NVIDIA H200 and H100 GPUs (sm_90) with flashinfer-python 0.6.11.post2: against REFERENCE "
    "on random bfloat16 inputs (prefill, chunked prefill, decode, mixed batches, GQA 2/4/8, sliding window, "
    "soft-capping; head sizes 64/128/256; block sizes 16/32), slots of -1 left unwritten, decode replayed from "
    "a CUDA graph at new lengths, whole-model greedy output against HF (float16), graphs on and off identical"
)


def group_key(spec: AttentionLayerSpec) -> tuple:
    """Layers with the same key share one plan."""
    return (spec.num_heads, spec.num_kv_heads, spec.head_size, spec.scale, spec.sliding_window, spec.logit_softcap)


@dataclass
class FlashInferMetadata:
    """One step's plans: wrappers by layer group, for the decodes and for the rest."""

    slot_mapping: torch.Tensor
    num_decodes: int
    decode: dict[tuple, Any] | None
    prefill: dict[tuple, Any] | None


@dataclass
class PageTable:
    """A batch's pages in FlashInfer's CSR form, on the host."""

    indptr: torch.Tensor  # int32 [seqs + 1]
    indices: torch.Tensor  # int32 [indptr[-1]]
    last_page_len: torch.Tensor  # int32 [seqs]

    @classmethod
    def of(cls, batch: AttentionBatch) -> "PageTable":
        bs = batch.block_size
        seq_lens = batch.seq_lens_cpu.numpy().astype(np.int64)
        pages = (seq_lens + bs - 1) // bs
        indptr = np.zeros(batch.num_seqs + 1, dtype=np.int32)
        np.cumsum(pages, out=indptr[1:])
        table = batch.block_table_cpu
        if table is None:  # a caller without the host table: one device-to-host copy
            table = batch.block_table.cpu()
        indices = table.numpy()[np.arange(table.shape[1]) < pages[:, None]]  # row by row: the CSR order
        last = (seq_lens - (pages - 1) * bs).astype(np.int32)
        return cls(torch.from_numpy(indptr), torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int32)),
                   torch.from_numpy(last))


class FlashInferMetadataBuilder(AttentionMetadataBuilder):
    """Plans FlashInfer's decode and prefill wrappers once per step, for every layer group."""

    independent_builds = False  # the wrappers hold one plan each

    def __init__(self, backend, layer_specs, block_size, device, dtype):
        super().__init__(backend, layer_specs, block_size, device, dtype)
        import flashinfer

        self.flashinfer = flashinfer
        self.groups: dict[tuple, AttentionLayerSpec] = {}
        for spec in layer_specs:
            self.groups.setdefault(group_key(spec), spec)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.decode = {key: flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                          use_tensor_cores=True)
                       for key in self.groups}
        self.prefill = {key: flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                            backend=PREFILL_BACKEND)
                        for key in self.groups}
        self.graph_decode: dict[int, dict[tuple, Any]] = {}
        self.graph_indices: torch.Tensor | None = None

    def build(self, batch: AttentionBatch) -> FlashInferMetadata:
        return self._build(batch, self.decode, graph=False)

    def build_for_graph(self, batch: AttentionBatch, graph_size: int) -> FlashInferMetadata:
        if graph_size not in self.graph_decode:
            self.graph_decode[graph_size] = self._graph_wrappers(graph_size, batch.block_table.shape[1])
        return self._build(batch, self.graph_decode[graph_size], graph=True)

    def _graph_wrappers(self, size: int, width: int) -> dict[tuple, Any]:
        if self.graph_indices is None or self.graph_indices.numel() < size * width:
            self.graph_indices = torch.zeros(size * width, dtype=torch.int32, device=self.device)
        wrappers = {}
        for key in self.groups:
            wrappers[key] = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=self.device),
                paged_kv_indices_buffer=self.graph_indices,
                paged_kv_last_page_len_buffer=torch.zeros(size, dtype=torch.int32, device=self.device))
        return wrappers

    def _build(self, batch: AttentionBatch, decode_wrappers, graph: bool) -> FlashInferMetadata:
        pages = PageTable.of(batch)
        nd, bs = batch.num_decodes, self.block_size
        split = int(pages.indptr[nd])
        # In graph mode FlashInfer copies the indices with a blocking copy unless they are already on the device.
        indices = to_device(pages.indices, self.device) if graph else pages.indices
        decode = prefill = None
        if nd:
            for key, wrapper in decode_wrappers.items():
                spec = self.groups[key]
                wrapper.plan(pages.indptr[:nd + 1], indices[:split], pages.last_page_len[:nd],
                             spec.num_heads, spec.num_kv_heads, spec.head_size, bs, **self._options(spec))
            decode = decode_wrappers
        if nd < batch.num_seqs:
            qo_indptr = batch.query_start_loc_cpu[nd:] - batch.query_start_loc_cpu[nd]
            for key, wrapper in self.prefill.items():
                spec = self.groups[key]
                wrapper.plan(qo_indptr, pages.indptr[nd:] - split, indices[split:], pages.last_page_len[nd:],
                             spec.num_heads, spec.num_kv_heads, spec.head_size, bs, causal=True,
                             **self._options(spec))
            prefill = self.prefill
        return FlashInferMetadata(batch.slot_mapping, nd, decode, prefill)

    def _options(self, spec: AttentionLayerSpec) -> dict:
        return dict(window_left=spec.sliding_window - 1 if spec.sliding_window else -1,
                    logits_soft_cap=spec.logit_softcap or None, sm_scale=spec.scale,
                    q_data_type=self.dtype, kv_data_type=self.dtype)


class FlashInferImpl(AttentionImpl):
    """Writes the new keys and values, then runs the step's planned decode and prefill wrappers."""

    def __init__(self, spec: AttentionLayerSpec):
        super().__init__(spec)
        self.key = group_key(spec)
        self.write = write_kv_cache

    def forward(self, q, k, v, kv_cache, metadata: FlashInferMetadata):
        self.write(k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        cache = (kv_cache[0], kv_cache[1])
        nd = metadata.num_decodes
        if metadata.decode is not None:
            metadata.decode[self.key].run(q[:nd], cache, out=out[:nd])
        if metadata.prefill is not None:
            metadata.prefill[self.key].run(q[nd:], cache, out=out[nd:])
        return out


class FlashInferBackend(AttentionBackend):
    """FlashInfer's paged decode and prefill kernels, planned once per step."""

    name = "FLASHINFER"
    verification = VERIFICATION
    supported_head_sizes = (64, 128, 256)
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
        if importlib.util.find_spec("flashinfer") is None:
            return "the flashinfer-python package is not installed (pip install flashinfer-python)"
        return None

    @classmethod
    def metadata_builder_cls(cls):
        return FlashInferMetadataBuilder

    @classmethod
    def impl_cls(cls):
        return FlashInferImpl
