"""Per-step metadata of the ``ROCM_AITER`` backend, shaped for AITER's two entry points.

The engine's :class:`~dovetail.attention.batch.AttentionBatch` puts sequences
with one new token first (``num_decodes``). Those go to
``aiter.paged_attention_v1``, which reads the paged cache itself and takes, per
sequence, its block-table row, its context length (``seq_lens``, which counts
the token written this step) and ``cu_query_lens`` (``[num_seqs + 1]``, all
query lengths 1).

Every later sequence with new tokens goes to ``aiter.flash_attn_varlen_func``,
which takes packed, contiguous keys and values rather than a paged cache.
When no such sequence has cached context (a plain prefill), its keys are the
step's own ``k``/``v``; otherwise the builder lists, for every context position
of every sequence, the cache slot to gather it from (``kv_slots``), and
``cu_seqlens_k`` counts whole contexts. Its causal mask is aligned to the
bottom-right corner, which is exactly "the new tokens are the last ones".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dovetail.attention.backend import AttentionMetadataBuilder
from dovetail.attention.batch import AttentionBatch
from dovetail.device_copy import values_to_device


#: Tokens per partition of ``paged_attention_v1``'s split-K reduction (the value vLLM and AITER's tests use).
PARTITION_SIZE = 256


@dataclass
class AiterDecodeMetadata:
    """Arguments of ``paged_attention_v1`` for the leading one-token sequences."""

    num_seqs: int
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    max_seq_len: int
    workspace: torch.Tensor  # uint8 scratch for the split-K partitions, shared by the step's layers


@dataclass
class AiterPrefillMetadata:
    """Arguments of ``flash_attn_varlen_func`` for the token rows ``token_start:token_end``."""

    token_start: int
    token_end: int
    cu_seqlens_q: torch.Tensor  # int32 [n + 1], relative to token_start
    cu_seqlens_k: torch.Tensor  # int32 [n + 1]
    max_seqlen_q: int
    max_seqlen_k: int
    min_seqlen_q: int
    kv_slots: torch.Tensor | None  # int64 [cu_seqlens_k[-1]]; None: keys are this step's k/v rows


@dataclass
class AiterAttentionMetadata:
    """One step's metadata, shared by every layer."""

    num_tokens: int
    slot_mapping: torch.Tensor
    decode: AiterDecodeMetadata | None
    prefill: AiterPrefillMetadata | None
    k_scale: torch.Tensor  # float32 [1] = 1.0: the cache is not quantized
    v_scale: torch.Tensor


def _cumulative(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


class AiterMetadataBuilder(AttentionMetadataBuilder):
    """Splits the step into AITER's decode and varlen-prefill calls (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.unit_scale = torch.ones(1, dtype=torch.float32, device=self.device)

    def build(self, batch: AttentionBatch) -> AiterAttentionMetadata:
        qsl = batch.query_start_loc_cpu.tolist()
        seq_lens = batch.seq_lens_cpu.tolist()
        nd = batch.num_decodes
        decode = None
        if nd:
            max_seq_len = max(seq_lens[:nd])
            decode = AiterDecodeMetadata(
                num_seqs=nd, block_table=batch.block_table[:nd], seq_lens=batch.seq_lens[:nd],
                query_start_loc=batch.query_start_loc[:nd + 1], max_seq_len=max_seq_len,
                workspace=torch.empty(self._workspace_bytes(nd, max_seq_len), dtype=torch.uint8, device=self.device))
        return AiterAttentionMetadata(num_tokens=batch.num_tokens, slot_mapping=batch.slot_mapping, decode=decode,
                                      prefill=self._prefill(batch, qsl, seq_lens, nd),
                                      k_scale=self.unit_scale, v_scale=self.unit_scale)

    def _workspace_bytes(self, num_seqs: int, max_seq_len: int) -> int:
        """paged_attention_v1's scratch: per sequence, head and partition, a partial output row of the
        query's dtype plus two float32 values (the exp-sum and the max logit)."""
        partitions = -(-max_seq_len // PARTITION_SIZE)
        elem = torch.tensor([], dtype=self.dtype).element_size()
        per_partition = max(spec.num_heads * (spec.head_size * elem + 8) for spec in self.layer_specs)
        return num_seqs * partitions * per_partition

    def _prefill(self, batch: AttentionBatch, qsl: list[int], seq_lens: list[int],
                 nd: int) -> AiterPrefillMetadata | None:
        seqs = [i for i in range(nd, batch.num_seqs) if qsl[i + 1] > qsl[i]]
        if not seqs:
            return None
        q_lens = [qsl[i + 1] - qsl[i] for i in seqs]
        k_lens = [seq_lens[i] for i in seqs]
        has_context = any(k != q for q, k in zip(q_lens, k_lens))
        kv_slots = self._context_slots(batch, seqs, k_lens) if has_context else None
        return AiterPrefillMetadata(
            token_start=qsl[nd], token_end=qsl[batch.num_seqs],
            cu_seqlens_q=values_to_device(_cumulative(q_lens), torch.int32, self.device),
            cu_seqlens_k=values_to_device(_cumulative(k_lens if has_context else q_lens), torch.int32, self.device),
            max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens), min_seqlen_q=min(q_lens), kv_slots=kv_slots)

    def _context_slots(self, batch: AttentionBatch, seqs: list[int], k_lens: list[int]) -> torch.Tensor:
        """The cache slot of every position ``0..seq_len-1`` of every sequence, packed in order."""
        lengths = torch.tensor(k_lens)
        rows = torch.repeat_interleave(torch.tensor(seqs), lengths)
        starts = torch.repeat_interleave(torch.tensor(_cumulative(k_lens)[:-1]), lengths)
        positions = torch.arange(int(lengths.sum())) - starts
        rows, positions = rows.to(self.device), positions.to(self.device)
        block_size = batch.block_size
        blocks = batch.block_table[rows, positions // block_size].long()
        return blocks * block_size + positions % block_size
