"""CPU_SIMD: paged attention in C++ with SIMD intrinsics (AVX-512 / AVX512-BF16, AVX2+FMA, NEON or plain C++).

One call per layer writes the step's keys and values into the cache and attends every sequence of
the mixed prefill/decode batch, threaded across sequences, KV heads and query tiles (split across
the keys when there are fewer of those than threads). The KV-cache layout is the default
``[2, blocks, block_size, kv_heads, head_size]``; the cache may be bfloat16 under a float32 model
(``kv_cache_dtype="bfloat16"``: half the memory and bandwidth, keys and values rounded once).
"""

from __future__ import annotations

from abc import ABCMeta
from dataclasses import dataclass

import torch

from dovetail.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder
from dovetail.attention.batch import AttentionBatch
from dovetail.errors import DovetailError
from dovetail_cpu import kernels
from dovetail_cpu._native import AttentionArgs


@dataclass
class CpuSimdMetadata:
    """One step's batch and its prepared kernel arguments (shared by every layer of the step).

    ``args`` points into ``batch``'s tensors and ``block_table``, which this object keeps alive.
    """

    batch: AttentionBatch
    block_table: torch.Tensor
    args: AttentionArgs


def build_metadata(batch: AttentionBatch) -> CpuSimdMetadata:
    block_table = batch.block_table if batch.block_table.is_contiguous() else batch.block_table.contiguous()
    args = kernels.batch_args(batch.query_start_loc_cpu, batch.seq_lens_cpu, block_table, batch.slot_mapping,
                              batch.block_size, torch.get_num_threads())
    return CpuSimdMetadata(batch, block_table, args)


class CpuSimdMetadataBuilder(AttentionMetadataBuilder):
    """Prepares the kernel arguments that do not change from layer to layer, once per step."""

    def build(self, batch: AttentionBatch) -> CpuSimdMetadata:
        return build_metadata(batch)


class CpuSimdImpl(AttentionImpl):
    """Calls the C++ kernel: KV-cache write, then attention, in one call."""

    def forward(self, q, k, v, kv_cache, metadata):
        if isinstance(metadata, AttentionBatch):
            metadata = build_metadata(metadata)
        spec = self.spec
        return kernels.paged_attention(metadata.args, q, k, v, kv_cache, spec.scale, spec.sliding_window,
                                       spec.logit_softcap)


class _ReportsIsa(ABCMeta):
    @property
    def verification(cls) -> str:
        from dovetail_cpu import _native

        try:
            path = _native.current_isa()
            supported = ", ".join(_native.supported_isas())
            threads = "OpenMP" if _native.has_openmp() else "std::thread"
        except DovetailError as exc:
            return str(exc)
        return (f"kernel path here: {path} (this CPU runs: {supported}; force with DOVETAIL_CPU_ISA); "
                f"{threads} threads. Verified against REFERENCE on x86-64 (AVX-512 with BF16, AVX-512, AVX2, "
                "portable); the NEON variant of the portable path was compiled and tested only under emulation")


class CpuSimdBackend(AttentionBackend, metaclass=_ReportsIsa):
    """Paged attention for the CPU platform in C++ SIMD kernels, float32 and bfloat16."""

    name = "CPU_SIMD"
    supported_head_sizes = tuple(range(16, 257, 16))
    supported_dtypes = ("float32", "bfloat16")
    supported_kv_cache_dtypes = ("auto", "float32", "bfloat16")
    supported_device_types = ("cpu",)

    @classmethod
    def available(cls) -> str | None:
        from dovetail_cpu import _native

        return _native.missing_reason()

    @classmethod
    def metadata_builder_cls(cls):
        return CpuSimdMetadataBuilder

    @classmethod
    def impl_cls(cls):
        return CpuSimdImpl
