"""TRITON: the core's own paged attention in Triton, for the CUDA, ROCm and XPU platforms.

Each layer's forward makes at most three launches: the KV-cache write, the
decode sequences (which the batch puts first) with small query tiles and, when
the batch is small, the keys split over several programs, then the remaining
(prefill and chunked-prefill) sequences with larger query tiles. A split decode
launch (small batches, batch-1 decode) stores the decodes' own keys and values
itself and, given the layer's rotary (``forward_rotary``), rotates their q and k
(after Qwen 3's per-head norms): a small decode-only step then launches neither a
cache write nor a rotary kernel. Once per step the
metadata builder orders the decodes longest context first for the decode launch
(:mod:`dovetail.triton.paged_attention` says why). With ``kv_cache_dtype="fp8"`` the
cache holds e4m3 keys and values divided by the layer's ``k_scale``/``v_scale`` (1.0
unless the checkpoint has calibrated ones), half the bytes of a 16-bit cache: the
writes quantise and the attention dequantises as it loads. The kernels are in
:mod:`dovetail.triton`; this module imports them (and triton) only when a layer is
built, so it imports cleanly where triton is absent.
"""

from __future__ import annotations

import dataclasses

import torch

from dovetail.attention.backend import (AttentionBackend, AttentionImpl, AttentionLayerSpec, AttentionMetadataBuilder,
                                        RotaryInputs)
from dovetail.attention.batch import AttentionBatch
from dovetail.device_copy import copy_to_device, to_device


@dataclasses.dataclass
class TritonAttentionBatch(AttentionBatch):
    """The step's batch and ``decode_order``: int32 ``[num_decodes]`` on the device, the order in which the decode
    launch's programs take the decode sequences (None: as they come)."""

    decode_order: torch.Tensor | None = None

    @classmethod
    def of(cls, batch: AttentionBatch, decode_order: torch.Tensor | None) -> "TritonAttentionBatch":
        fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(AttentionBatch)}
        return cls(**fields, decode_order=decode_order)


def _longest_first(seq_lens_cpu: torch.Tensor) -> torch.Tensor:
    return torch.argsort(seq_lens_cpu, descending=True, stable=True).to(torch.int32)


class TritonMetadataBuilder(AttentionMetadataBuilder):
    """Orders the step's decodes longest context first, from the host's sequence lengths (one small copy a step).

    For a device graph the order goes into a buffer kept per graph size, which the captured launches read.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._graph_orders: dict[int, torch.Tensor] = {}

    def build(self, batch: AttentionBatch) -> TritonAttentionBatch:
        if not batch.num_decodes:
            return TritonAttentionBatch.of(batch, None)
        order = _longest_first(batch.seq_lens_cpu[:batch.num_decodes])
        return TritonAttentionBatch.of(batch, to_device(order, batch.seq_lens.device))

    def build_for_graph(self, batch: AttentionBatch, graph_size: int) -> TritonAttentionBatch:
        order = self._graph_orders.get(graph_size)
        if order is None:
            order = self._graph_orders[graph_size] = torch.empty(graph_size, dtype=torch.int32,
                                                                 device=batch.seq_lens.device)
        copy_to_device(order, _longest_first(batch.seq_lens_cpu[:graph_size]))
        return TritonAttentionBatch.of(batch, order)


class TritonAttentionImpl(AttentionImpl):
    """Writes the new keys and values, then attends decodes and prefills with the Triton kernel.

    ``metadata`` is the builder's :class:`TritonAttentionBatch`, or a plain :class:`AttentionBatch`, whose
    decodes are then taken as they come."""

    def __init__(self, spec: AttentionLayerSpec):
        super().__init__(spec)
        from dovetail.triton import kv_cache_write, paged_attention, rotary

        self._kv_cache_write = kv_cache_write
        self._paged_attention = paged_attention
        self._rotary = rotary

    def forward(self, q, k, v, kv_cache, metadata):
        return self._attend(q, k, v, kv_cache, metadata)

    def forward_rotary(self, q, k, v, kv_cache, metadata, rotary: RotaryInputs):
        """When the decode launch takes over the decodes' cache write (:meth:`_fuses_into_decode_launch`), it
        rotates their q and k too. The other rows go through the rotary kernel, which also stores their rotated
        keys and values in the cache (one launch instead of two), or else through ``rotary.apply``."""
        n, end = metadata.num_decodes, metadata.num_tokens
        if not self._paged_attention.rotary_fits(rotary, q, k):
            return super().forward_rotary(q, k, v, kv_cache, metadata, rotary)
        fused = self._fuses_into_decode_launch(n, q)
        start = n if fused else 0
        if fused or end == q.shape[0]:  # else the rotated rows would not make up the whole of q
            rows = slice(start, end)
            q_rest = self._rotate_into_cache(q[rows], k[rows], v[rows], kv_cache, metadata.slot_mapping[rows],
                                             rotary.positions[rows], rotary)
            if q_rest is not None and fused:
                return self._attend(q, k, v, kv_cache, metadata, rotary, (q_rest, None), written=True)
            if q_rest is not None:  # every row rotated, every key and value stored
                return self._attend(q_rest, k, v, kv_cache, metadata, written=True)
        if not fused:
            return super().forward_rotary(q, k, v, kv_cache, metadata, rotary)
        q_rest, k_rest = q[n:end], k[n:end]
        if n < end:
            q_rot, k_rot = rotary.apply(rotary.positions[n:end], q_rest.flatten(1), k_rest.flatten(1))
            q_rest, k_rest = q_rot.view(q_rest.shape), k_rot.view(k_rest.shape)
        return self._attend(q, k, v, kv_cache, metadata, rotary, (q_rest, k_rest))

    def _rotate_into_cache(self, q, k, v, kv_cache, slots, positions, rotary: RotaryInputs):
        """``q`` rotated at ``positions`` (``[rows, heads, head_size]``), with the rows' rotated keys and values
        stored at ``slots`` by the same launch; None where the rotary kernel cannot write this cache (nothing
        done)."""
        head_size = q.shape[-1]
        k2, v2 = k.flatten(1), v.flatten(1)
        if not q.shape[0] or not self._rotary.writes_cache(k2, v2, kv_cache[0], kv_cache[1], head_size,
                                                           rotary.rotary_dim):
            return None
        q_rot = self._rotary.rotary_embedding_into_cache(
            positions, q.flatten(1), k2, v2, kv_cache[0], kv_cache[1], slots, rotary.cos_sin_cache, head_size,
            rotary.q_norm_weight, rotary.k_norm_weight, rotary.eps)
        return q_rot.view(q.shape)

    def _fuses_into_decode_launch(self, num_decodes: int, q) -> bool:
        """Whether the decode launch stores the decodes' own keys and values (and, from :meth:`forward_rotary`,
        rotates their q and k) instead of separate launches doing it first: only when it splits the keys
        (small batches), where the launches saved shorten batch-1 decode. A launch that fills the device has
        many programs, each of which would do that work before its first key read, and B1 lost with the cache
        write and the rotation in every decode launch (benchmarks/RESULTS.md, "Tried and rejected")."""
        if not num_decodes:
            return False
        return self._paged_attention.default_num_splits(num_decodes, self.spec.num_kv_heads, q.device) > 1

    def _attend(self, q, k, v, kv_cache, metadata, rotary: RotaryInputs | None = None, rest=None,
                written: bool = False):
        """Write the cache (unless ``written``: the rows the decode launch does not store are in it already),
        then the decode launch on the first ``num_decodes`` rows, then the launch of the other sequences on
        ``rest`` (their q and k, when the caller rotated them; else ``q``'s and ``k``'s)."""
        spec = self.spec
        n, end = metadata.num_decodes, metadata.num_tokens
        fused = self._fuses_into_decode_launch(n, q)
        q_rest, k_rest = rest if rest is not None else (q[n:end], k[n:end])
        if not written:
            scales = (self.k_scale, self.v_scale)
            if not fused:
                self._kv_cache_write.write_kv_cache(k, v, kv_cache, metadata.slot_mapping, *scales)
            elif n < end:
                self._kv_cache_write.write_kv_cache(k_rest, v[n:end], kv_cache, metadata.slot_mapping[n:end],
                                                    *scales)
        if q.stride(-1) != 1:
            q = q.contiguous()
        if q_rest.stride(-1) != 1:
            q_rest = q_rest.contiguous()
        out = q.new_empty(q.shape)
        attention = self._paged_attention
        if n:
            attention.paged_attention(
                q, kv_cache[0], kv_cache[1], out, metadata.block_table, metadata.seq_lens,
                metadata.query_start_loc, num_tokens=n, num_seqs=n, decode=True,
                num_splits=attention.default_num_splits(n, spec.num_kv_heads, q.device),
                decode_order=getattr(metadata, "decode_order", None),
                new_kv=(k, v, metadata.slot_mapping) if fused else None, rotary=rotary if fused else None,
                **self._kernel_options())
        if n < metadata.num_seqs:
            self._attend_rest(q_rest, kv_cache, out[n:], metadata)
        return out

    def _attend_rest(self, q_rest, kv_cache, out_rest, metadata) -> None:
        """Attend the sequences after the decodes (prefills, chunked prefills) into ``out_rest``; their keys
        and values are in the cache already."""
        n = metadata.num_decodes
        self._paged_attention.paged_attention(
            q_rest, kv_cache[0], kv_cache[1], out_rest, metadata.block_table[n:], metadata.seq_lens[n:],
            metadata.query_start_loc[n:], num_tokens=metadata.num_tokens - n, num_seqs=metadata.num_seqs - n,
            decode=False, **self._kernel_options())

    def _kernel_options(self) -> dict:
        spec = self.spec
        return dict(scale=spec.scale, sliding_window=spec.sliding_window, logit_softcap=spec.logit_softcap,
                    k_scale=self.k_scale, v_scale=self.v_scale)


class TritonBackend(AttentionBackend):
    """Paged attention in Triton: prefill, chunked prefill and decode in one kernel; GQA,
    sliding window and logit soft-capping; float16, bfloat16 and float32; a 16/32-bit or an FP8 (e4m3) KV cache."""

    name = "TRITON"
    verification = ("ran on NVIDIA H200 and H100 GPUs (triton 3.6, launched with programmatic "
                    "dependent launch): the kernels against REFERENCE case by case (head sizes "
                    "64-256, block sizes, window, soft-capping, GQA, the split decode launch's own cache write and "
                    "rotation, the rotary kernel's cache write), in whole models (greedy output against HF, "
                    "CUDA-graph decode on and off, batch-1 decode) and in the B1/B2 benchmarks. In CI: against "
                    "REFERENCE in triton's CPU interpreter. The FP8 KV cache: in triton's CPU interpreter only "
                    "(kernels against REFERENCE, the engine's greedy output). Never run on an AMD or Intel GPU")
    # Any head size works (padded to a power of two); these are the ones tested.
    supported_head_sizes = (32, 64, 80, 96, 112, 128, 160, 192, 256)
    supported_dtypes = ("float16", "bfloat16", "float32")
    supported_kv_cache_dtypes = ("auto", "fp8", "fp8_e4m3")
    supported_block_sizes = None
    supports_sliding_window = True
    supports_logit_softcap = True
    supports_gqa = True
    supported_device_types = ("cuda", "xpu")
    supports_graph_capture = True
    supports_uniform_query_graphs = True

    @classmethod
    def available(cls) -> str | None:
        from dovetail.triton import triton_missing_reason

        return triton_missing_reason()

    @classmethod
    def impl_cls(cls):
        return TritonAttentionImpl

    @classmethod
    def metadata_builder_cls(cls):
        return TritonMetadataBuilder
