"""REFERENCE: paged attention in plain torch, on any device; the oracle for every backend.

It computes in float32 whatever the model's dtype, gathers each sequence's keys
and values through its block table, and applies the causal, sliding-window and
soft-capping rules exactly as :mod:`dovetail.attention.backend` defines them
(through torch's ``scaled_dot_product_attention`` with an explicit mask, or
written out when soft-capping is on).
Decodes are attended together in one padded batch; prefills one sequence at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dovetail.attention.backend import AttentionBackend, AttentionImpl, AttentionLayerSpec
from dovetail.attention.batch import AttentionBatch


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """Store new keys/values at their slots in a ``[2, blocks, block_size, kv_heads, head]`` cache
    (a negative slot skips its token); returns whether every token was stored."""
    num_kv_heads, head_size = kv_cache.shape[-2], kv_cache.shape[-1]
    key_cache = kv_cache[0].view(-1, num_kv_heads, head_size)
    value_cache = kv_cache[1].view(-1, num_kv_heads, head_size)
    valid = slot_mapping >= 0
    every_slot = bool(valid.all())
    if not every_slot:
        slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
    key_cache.index_copy_(0, slot_mapping, k.to(key_cache.dtype))
    value_cache.index_copy_(0, slot_mapping, v.to(value_cache.dtype))
    return every_slot


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
           k_len: torch.Tensor, spec: AttentionLayerSpec) -> torch.Tensor:
    """Attention for a padded batch, in float32.

    ``q``: ``[B, Lq, Hq, D]``; ``k``, ``v``: ``[B, Lk, Hkv, D]`` (key ``j`` is at
    position ``j``); ``q_pos``: ``[B, Lq]`` absolute positions of the queries;
    ``k_len``: ``[B]`` valid keys per sequence. Returns ``[B, Lq, Hq, D]`` float32.
    """
    k_pos = torch.arange(k.shape[1], device=q.device).view(1, 1, -1)
    visible = (k_pos <= q_pos.unsqueeze(-1)) & (k_pos < k_len.view(-1, 1, 1))
    if spec.sliding_window:
        visible &= k_pos > (q_pos.unsqueeze(-1) - spec.sliding_window)
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))  # [B, H, L, D]
    if not spec.logit_softcap:
        out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=visible.unsqueeze(1), scale=spec.scale,
                                             enable_gqa=True)
        return out.transpose(1, 2)
    group = q.shape[2] // k.shape[2]
    kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * spec.scale
    scores = torch.tanh(scores / spec.logit_softcap) * spec.logit_softcap
    probs = torch.softmax(scores.masked_fill(~visible.unsqueeze(1), float("-inf")), dim=-1)
    return torch.matmul(probs, vf).transpose(1, 2)


def gather_kv(kv_cache: torch.Tensor, block_table_row: torch.Tensor, num_blocks: int):
    """Keys and values of one or more sequences, ``[..., num_blocks * block_size, kv_heads, head]``."""
    table = block_table_row[..., :num_blocks].long()
    keys = kv_cache[0][table]
    values = kv_cache[1][table]
    shape = (*table.shape[:-1], -1, *kv_cache.shape[-2:])
    return keys.reshape(shape), values.reshape(shape)


class ReferenceAttentionImpl(AttentionImpl):
    """Plain-torch paged attention for one layer."""

    def forward(self, q, k, v, kv_cache, metadata: AttentionBatch):
        # A whole prompt attends to exactly the keys and values it just stored: no gather needed.
        stored_as_is = write_kv_cache(k, v, kv_cache, metadata.slot_mapping) and kv_cache.dtype == k.dtype
        out = torch.empty_like(q)
        block_size = metadata.block_size
        qsl = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        nd = metadata.num_decodes
        if nd:
            max_len = max(seq_lens[:nd])
            blocks = -(-max_len // block_size)
            keys, values = gather_kv(kv_cache, metadata.block_table[:nd], blocks)
            k_len = metadata.seq_lens[:nd].long()
            q_pos = (k_len - 1).view(nd, 1)
            out[:nd] = attend(q[:nd].unsqueeze(1), keys, values, q_pos, k_len, self.spec).squeeze(1).to(q.dtype)
        for i in range(nd, metadata.num_seqs):
            start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
            if end == start:
                continue
            if end - start == seq_len and stored_as_is:
                keys, values = k[start:end], v[start:end]
            else:
                keys, values = gather_kv(kv_cache, metadata.block_table[i], -(-seq_len // block_size))
            q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device).view(1, -1)
            k_len = torch.tensor([seq_len], device=q.device)
            out[start:end] = attend(q[start:end].unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                    q_pos, k_len, self.spec)[0].to(q.dtype)
        return out


class ReferenceBackend(AttentionBackend):
    """The plain-torch oracle: every head size, dtype, block size and feature, on any device."""

    name = "REFERENCE"
    verification = "verified on CPU (CI); the oracle of every other backend"

    @classmethod
    def impl_cls(cls):
        return ReferenceAttentionImpl
