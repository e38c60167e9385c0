"""``ROCM_AITER``: paged attention through AMD's AITER library (``aiter`` package).

Two public AITER functions do the work, called as AITER's sources define them
(read at ROCm/aiter ``aiter/ops/attention.py``, ``csrc/cpp_itfs/pa/pa_v1.py``
and ``aiter/ops/mha.py``, and as vLLM's ROCm AITER backend calls them):

- ``aiter.paged_attention_v1`` for the one-token decodes: query
  ``[seqs, heads, head_size]``; key and value caches in the ``"NHD"`` layout
  ``[blocks, block_size, kv_heads, head_size]``; int32 block tables, context
  lengths and ``cu_query_lens``; a uint8 workspace of
  ``seqs * heads * partitions * (head_size * elem_size + 8)`` bytes, with
  ``partitions = ceil(max_context_len / partition_size)``; float32 tensors
  ``k_scale``/``v_scale``; ``sliding_window=w`` keeps the last ``w`` keys
  (aiter >= 0.1.8); ``logits_soft_cap`` 0 means none.
- ``aiter.flash_attn_varlen_func`` for everything else: packed ``q``/``k``/``v``
  with int32 ``cu_seqlens_q``/``cu_seqlens_k``, ``causal=True`` aligned to the
  bottom-right corner, ``window_size=(w - 1, 0)`` for a window of ``w``.

The KV cache is the core's default ``[2, blocks, block_size, kv_heads, head_size]``,
whose halves are exactly the ``"NHD"`` caches; new keys and values are written
with plain torch. Which of these code paths ran on real hardware: none (see
``verification``).
"""

from __future__ import annotations

import importlib
import inspect

import torch

from dovetail.attention.backend import AttentionBackend, AttentionImpl, AttentionRequirements
from dovetail.attention.reference import write_kv_cache
from dovetail.errors import PluginError
from dovetail_rocm.aiter_metadata import PARTITION_SIZE, AiterAttentionMetadata, AiterMetadataBuilder
from dovetail_rocm.aiter_support import aiter_unavailable_reason

VERIFICATION = (
    "NOT verified on hardware: no AMD GPU was available, and real aiter was never executed. Never run: "
    "aiter.paged_attention_v1 and aiter.flash_attn_varlen_func themselves, and every tensor placed on a HIP "
    "device. Tested on CPU: the argument marshalling (NHD cache layout, int32 metadata, workspace size, "
    "window and soft-cap arguments, context gathering for chunked prefill) against a fake 'aiter' that "
    "checks arguments as aiter's wrappers do and computes with the semantics read in aiter's sources, "
    "compared with REFERENCE."
)


def gqa_ratio_supported(num_heads: int, num_kv_heads: int) -> bool:
    """paged_attention_v1 splits a GQA group into ceil(ratio / 16) equal loops, so the split must be exact."""
    ratio = num_heads // num_kv_heads
    loops = -(-ratio // 16)
    return ratio % loops == 0


def _import_aiter():
    aiter = importlib.import_module("aiter")
    missing = [f for f in ("paged_attention_v1", "flash_attn_varlen_func") if not hasattr(aiter, f)]
    if missing:
        raise PluginError(f"the installed aiter ({getattr(aiter, '__file__', '?')}) has no "
                          f"{' or '.join(missing)}, which ROCM_AITER calls")
    return aiter


class RocmAiterImpl(AttentionImpl):
    """One layer's attention through AITER's paged decode and varlen prefill."""

    def __init__(self, spec):
        super().__init__(spec)
        self.aiter = _import_aiter()
        window = spec.sliding_window
        self.decode_window = {"sliding_window": window} if window else {}
        self.prefill_window = (window - 1, 0) if window else (-1, -1)
        self.softcap = float(spec.logit_softcap or 0.0)

    def forward(self, q, k, v, kv_cache, metadata: AiterAttentionMetadata):
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        out = torch.zeros_like(q) if q.shape[0] > metadata.num_tokens else torch.empty_like(q)
        if metadata.decode is not None:
            self._decode(q, key_cache, value_cache, out, metadata)
        if metadata.prefill is not None:
            self._prefill(q, k, v, key_cache, value_cache, out, metadata)
        return out

    def _decode(self, q, key_cache, value_cache, out, metadata: AiterAttentionMetadata):
        d = metadata.decode
        self.aiter.paged_attention_v1(
            out=out[:d.num_seqs], workspace_buffer=d.workspace, query=q[:d.num_seqs],
            key_cache=key_cache, value_cache=value_cache, scale=self.spec.scale,
            block_tables=d.block_table, cu_query_lens=d.query_start_loc, context_lens=d.seq_lens,
            max_context_len=d.max_seq_len, alibi_slopes=None, kv_cache_dtype="auto", kv_cache_layout="NHD",
            logits_soft_cap=self.softcap, k_scale=metadata.k_scale, v_scale=metadata.v_scale,
            fp8_out_scale=None, partition_size=PARTITION_SIZE, **self.decode_window)

    def _prefill(self, q, k, v, key_cache, value_cache, out, metadata: AiterAttentionMetadata):
        p = metadata.prefill
        rows = slice(p.token_start, p.token_end)
        if p.kv_slots is None:
            keys, values = k[rows], v[rows]
        else:
            kv_heads, head_size = key_cache.shape[-2], key_cache.shape[-1]
            keys = key_cache.reshape(-1, kv_heads, head_size).index_select(0, p.kv_slots)
            values = value_cache.reshape(-1, kv_heads, head_size).index_select(0, p.kv_slots)
        result = self.aiter.flash_attn_varlen_func(
            q=q[rows], k=keys, v=values, cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k,
            max_seqlen_q=p.max_seqlen_q, max_seqlen_k=p.max_seqlen_k, min_seqlen_q=p.min_seqlen_q,
            dropout_p=0.0, softmax_scale=self.spec.scale, logits_soft_cap=self.softcap, causal=True,
            window_size=self.prefill_window)
        out[rows] = result


class RocmAiterBackend(AttentionBackend):
    """AMD AITER paged attention on ROCm: float16/bfloat16, head sizes 64/128/256, blocks of 16 or 32,
    on gfx90a, gfx942 and gfx950 GPUs (the targets aiter's decode kernel is built for)."""

    name = "ROCM_AITER"
    verification = VERIFICATION
    # Head sizes and block sizes as vLLM's AITER backend declares them; AITER's own
    # paged_attention_v1 tests cover head sizes 64 and 128 and block sizes 1, 16, 32.
    supported_head_sizes = (64, 128, 256)
    supported_dtypes = ("float16", "bfloat16")
    supported_kv_cache_dtypes = ("auto",)
    supported_block_sizes = (16, 32)
    supports_sliding_window = True
    supports_logit_softcap = True
    supports_gqa = True
    supported_device_types = ("cuda",)
    supports_graph_capture = False

    @classmethod
    def available(cls) -> str | None:
        return aiter_unavailable_reason()

    @classmethod
    def validate(cls, req: AttentionRequirements) -> list[str]:
        reasons = super().validate(req)
        if req.num_kv_heads and req.num_heads % req.num_kv_heads == 0 and \
                not gqa_ratio_supported(req.num_heads, req.num_kv_heads):
            reasons.append(f"{req.num_heads // req.num_kv_heads} query heads per KV head not supported by "
                           f"{cls.name} (paged_attention_v1 needs a ratio of at most 16, or one that splits "
                           "into equal groups of at most 16)")
        if req.uses_sliding_window and req.uses_logit_softcap:
            reasons.append(f"sliding-window attention combined with logit soft-capping not supported by {cls.name} "
                           "(paged_attention_v1 soft-caps after masking, so keys outside the window keep the "
                           "logit -cap instead of -inf)")
        if req.uses_sliding_window and not reasons:
            problem = cls._sliding_window_problem()
            if problem:
                reasons.append(problem)
        return reasons

    @classmethod
    def _sliding_window_problem(cls) -> str | None:
        try:
            decode = _import_aiter().paged_attention_v1
        except Exception as exc:  # a broken aiter install must be a reason, not a crash
            return f"importing aiter failed: {type(exc).__name__}: {exc}"
        if "sliding_window" not in inspect.signature(decode).parameters:
            return (f"sliding-window attention in {cls.name} needs aiter >= 0.1.8 "
                    "(paged_attention_v1 has no sliding_window argument in the installed version)")
        return None

    @classmethod
    def kv_cache_shape(cls, num_blocks, block_size, num_kv_heads, head_size):
        """``[2, blocks, block_size, kv_heads, head_size]``: key and value caches in AITER's "NHD" layout."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def metadata_builder_cls(cls):
        return AiterMetadataBuilder

    @classmethod
    def impl_cls(cls):
        return RocmAiterImpl
