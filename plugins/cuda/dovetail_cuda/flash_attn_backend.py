"""``FLASH_ATTN``: paged attention through the ``flash_attn`` package (FlashAttention 2, 3 or 4).

One call per layer covers the whole mixed batch, as the packages document it:

- FlashAttention-3 (the ``flash_attn_interface`` module built from the
  repository's ``hopper/`` folder; used on sm_90): ``flash_attn_with_kvcache``
  with ``page_table`` (any block size), ``cache_seqlens``, and the packed
  queries described by ``cu_seqlens_q`` / ``max_seqlen_q``.
- FlashAttention-4 (``pip install flash-attn-4``: the CuTe DSL kernels of
  ``flash_attn.cute``, compiled on first use; used on sm_90 without FA3, and on
  sm_100/sm_110): ``flash_attn_varlen_func`` with ``page_table`` (any block
  size), ``seqused_k`` and ``cu_seqlens_q``. On Hopper it has no split-KV and
  a 128-row query tile, which a decode fills with the few query heads of one
  KV head: there it takes only the prefills, and the decodes go through the
  core's Triton kernel (:class:`FlashAttn4PrefillImpl`).
- FlashAttention-2 (``flash_attn`` >= 2.6): ``flash_attn_varlen_func`` with
  ``block_table``; its paged cache needs blocks of a multiple of 256 tokens.

All take the ``NHD`` halves of the core's ``[2, blocks, block_size, kv_heads,
head_size]`` cache, align ``causal=True`` to the end of the keys, and keep keys
``[i + sk - sq - left, i + sk - sq]`` for ``window_size=(left, 0)``: a window
of ``w`` tokens is ``left = w - 1``.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from dovetail.attention.backend import (AttentionBackend, AttentionImpl, AttentionMetadataBuilder,
                                        AttentionRequirements)
from dovetail.attention.batch import AttentionBatch
from dovetail.attention.triton_backend import TritonAttentionImpl, TritonBackend, TritonMetadataBuilder
from dovetail.device_copy import copy_to_device, to_device
from dovetail.triton import triton_missing_reason
from dovetail_cuda.kv_write import write_kv_cache

#: FlashAttention-2 refuses paged caches whose block size is not a multiple of this.
FA2_BLOCK_MULTIPLE = 256
#: Compute capability majors whose FlashAttention-4 kernels read a paged cache (Hopper, Blackwell).
FA4_CAPABILITY_MAJORS = (9, 10, 11)

VERIFICATION = (
    "FlashAttention-4 verified on one NVIDIA H100 (sm_90, the H200's architecture) with flash-attn-4 4.0.0b36 and "
    "nvidia-cutlass-dsl 4.8.1, both alone and taking only the prefills with Triton decoding (as it "
    "runs on Hopper now): against REFERENCE on random bfloat16 inputs (prefill, chunked "
    "prefill, decode, mixed batches, GQA, sliding window, soft-capping; head sizes 64/128/256; block sizes "
    "16/32), slots of -1 left unwritten, decode replayed from a CUDA graph at new lengths, whole-model greedy "
    "output against HF (float16), graphs on and off identical. FlashAttention-4 on Blackwell (which it takes "
    "whole there), FlashAttention-2 and FlashAttention-3 NOT verified: never run on such a GPU or built for "
    "one here; tested on the CPU against stand-ins only"
)


def fa3_installed() -> bool:
    return importlib.util.find_spec("flash_attn_interface") is not None


def fa2_installed() -> bool:
    """flash-attn 2 makes ``flash_attn`` a regular package; flash-attn-4 alone leaves it a namespace."""
    spec = importlib.util.find_spec("flash_attn")
    return spec is not None and spec.origin not in (None, "namespace")


def _fa4_kernels_present() -> bool:
    spec = importlib.util.find_spec("flash_attn")
    return spec is not None and any(Path(path, "cute", "interface.py").is_file()
                                    for path in spec.submodule_search_locations or ())


def _cute_dsl_cuda_present() -> bool:
    """A CUDA flavour of the CuTe DSL (``nvidia-cutlass-dsl-libs-cu12`` or ``-cu13``): without one it cannot load."""
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    return spec is not None and any(next(Path(path, "dsl_packages", "cutlass", "_mlir", "_mlir_libs")
                                         .glob("_cutlass_ir.cu*"), None) is not None
                                    for path in spec.submodule_search_locations or ())


def fa4_installed() -> bool:
    """flash-attn-4's ``flash_attn/cute`` and a CUDA flavour of the CuTe DSL it compiles with."""
    return _fa4_kernels_present() and _cute_dsl_cuda_present()


def _capability_major() -> int:
    return torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 0


def variant(capability_major: int | None = None) -> str | None:
    """The FlashAttention build for this GPU: ``fa3`` (Hopper), ``fa4`` (Hopper, Blackwell), ``fa2`` or None."""
    if capability_major is None:
        capability_major = _capability_major()
    if capability_major == 9 and fa3_installed():
        return "fa3"
    if capability_major in FA4_CAPABILITY_MAJORS and fa4_installed():
        return "fa4"
    return "fa2" if fa2_installed() else None


def decodes_in_triton() -> bool:
    """FlashAttention-4 on Hopper: its prefills only, the decodes in the core's Triton kernel."""
    return variant() == "fa4" and _capability_major() == 9


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
        cu_k = to_device(self._cu_seqlens_k(batch), self.device)
        return self._metadata(batch, cu_k)

    def build_for_graph(self, batch: AttentionBatch, graph_size: int) -> FlashAttnMetadata:
        if self.graph_cu_seqlens_k is None or self.graph_cu_seqlens_k.numel() < graph_size + 1:
            self.graph_cu_seqlens_k = torch.zeros(graph_size + 1, dtype=torch.int32, device=self.device)
        cu_k = self.graph_cu_seqlens_k[:graph_size + 1]
        copy_to_device(cu_k, self._cu_seqlens_k(batch))
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


_MODULES = {"fa2": ("flash_attn", "flash_attn_varlen_func"),
            "fa3": ("flash_attn_interface", "flash_attn_with_kvcache"),
            "fa4": ("flash_attn.cute", "flash_attn_varlen_func")}


def _load_attend(build: str | None):
    """The attention function of FlashAttention build ``build``; a failed import names the backend and build."""
    if build is None:
        raise RuntimeError("FLASH_ATTN: no FlashAttention build runs on this GPU")
    module, function = _MODULES[build]
    try:
        return getattr(importlib.import_module(module), function)
    except Exception as exc:
        raise RuntimeError(f"FLASH_ATTN: importing {module} ({build}) failed: {exc}") from exc


def _window(spec) -> tuple[int, int]:
    return (spec.sliding_window - 1, 0) if spec.sliding_window else (-1, -1)


class FlashAttnImpl(AttentionImpl):
    """Writes the new keys and values, then one FlashAttention call over the mixed batch."""

    def __init__(self, spec):
        super().__init__(spec)
        self.variant = variant()
        self.attend = _load_attend(self.variant)
        self.write = write_kv_cache
        self.window = _window(spec)

    def forward(self, q, k, v, kv_cache, metadata: FlashAttnMetadata):
        self.write(k, v, kv_cache, metadata.slot_mapping)
        spec = self.spec
        options = dict(softmax_scale=spec.scale, causal=True, window_size=self.window,
                       softcap=spec.logit_softcap or 0.0)
        if self.variant == "fa3":
            return self.attend(q, kv_cache[0], kv_cache[1], cache_seqlens=metadata.seq_lens,
                               page_table=metadata.block_table, cu_seqlens_q=metadata.query_start_loc,
                               max_seqlen_q=metadata.max_query_len, **options)
        if self.variant == "fa4":
            out, _ = self.attend(q, kv_cache[0], kv_cache[1], cu_seqlens_q=metadata.query_start_loc,
                                 seqused_k=metadata.seq_lens, max_seqlen_q=metadata.max_query_len,
                                 page_table=metadata.block_table, **options)
            return out
        return self.attend(q, kv_cache[0], kv_cache[1], metadata.query_start_loc, metadata.cu_seqlens_k,
                           metadata.max_query_len, metadata.max_seq_len, block_table=metadata.block_table,
                           **options)


class FlashAttn4PrefillImpl(TritonAttentionImpl):
    """FlashAttention-4 for the prefills and chunked prefills, the core's Triton kernel for the decodes (Hopper).

    FA4 alone ran B1 about 9% behind TRITON on Hopper (benchmarks/RESULTS.md, "Tried and rejected"): its
    decode launches fill a 128-row query tile with 4 rows and cannot split the keys. So the decodes, their cache write and rotary go as in TRITON, and FA4 takes the
    other sequences of the step, whose keys and values are in the cache by then.
    """

    def __init__(self, spec):
        super().__init__(spec)
        self.attend = _load_attend("fa4")
        self.window = _window(spec)

    def _attend_rest(self, q_rest, kv_cache, out_rest, metadata) -> None:
        spec, n = self.spec, metadata.num_decodes
        out, _ = self.attend(q_rest, kv_cache[0], kv_cache[1], cu_seqlens_q=metadata.query_start_loc[n:] - n,
                             seqused_k=metadata.seq_lens[n:], max_seqlen_q=metadata.max_query_len,
                             page_table=metadata.block_table[n:], softmax_scale=spec.scale, causal=True,
                             window_size=self.window, softcap=spec.logit_softcap or 0.0)
        out_rest.copy_(out)


class FlashAttnBackend(AttentionBackend):
    """FlashAttention-3 on Hopper, FlashAttention-4 on Hopper or Blackwell, else FlashAttention-2
    (blocks of a multiple of 256 tokens)."""

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
        if not (fa2_installed() or fa3_installed() or fa4_installed()):
            if _fa4_kernels_present():
                return ("flash-attn-4 is installed, but the CuTe DSL it compiles with has no CUDA libraries "
                        "(pip install 'nvidia-cutlass-dsl[cu13]', or nvidia-cutlass-dsl-libs-cu12)")
            return ("the flash-attn package is not installed (pip install flash-attn; on Hopper or Blackwell "
                    "pip install flash-attn-4, or build hopper/ of github.com/Dao-AILab/flash-attention for "
                    "FlashAttention-3)")
        return None

    @classmethod
    def validate(cls, req: AttentionRequirements) -> list[str]:
        reasons = super().validate(req)
        if cls.available() is not None:
            return reasons
        chosen = variant()
        if chosen is None:
            reasons.append(f"the installed FlashAttention (3 needs sm_90, 4 needs sm_90/sm_100/sm_110) does not "
                           f"run on this GPU for {cls.name}")
        elif chosen == "fa4" and decodes_in_triton():
            if missing := triton_missing_reason():
                reasons.append(f"{cls.name} with FlashAttention-4 on Hopper decodes through Triton: {missing}")
            elif req.head_size not in TritonBackend.supported_head_sizes:
                reasons.append(f"head size {req.head_size} not supported by {cls.name} with FlashAttention-4 on "
                               f"Hopper (its decodes go through Triton: {TritonBackend.supported_head_sizes})")
        elif chosen == "fa2" and req.block_size % FA2_BLOCK_MULTIPLE:
            reasons.append(f"block size {req.block_size} not supported by {cls.name} with FlashAttention-2 "
                           f"(its paged cache needs a multiple of {FA2_BLOCK_MULTIPLE}: "
                           f"--block-size {FA2_BLOCK_MULTIPLE})")
        return reasons

    @classmethod
    def metadata_builder_cls(cls):
        return TritonMetadataBuilder if decodes_in_triton() else FlashAttnMetadataBuilder

    @classmethod
    def impl_cls(cls):
        return FlashAttn4PrefillImpl if decodes_in_triton() else FlashAttnImpl
