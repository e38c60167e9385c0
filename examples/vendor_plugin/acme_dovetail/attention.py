"""``TOY_ATTN``: paged attention through torch's scaled_dot_product_attention, a sequence at a time."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dovetail.attention.backend import AttentionBackend, AttentionImpl


class ToyAttentionImpl(AttentionImpl):
    """Writes the new keys/values, then runs SDPA per sequence over its gathered blocks."""

    def forward(self, q, k, v, kv_cache, metadata):
        spec = self.spec
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        block_size = key_cache.shape[1]
        flat_k = key_cache.view(-1, spec.num_kv_heads, spec.head_size)
        flat_v = value_cache.view(-1, spec.num_kv_heads, spec.head_size)
        keep = metadata.slot_mapping >= 0
        flat_k[metadata.slot_mapping[keep]] = k[keep]
        flat_v[metadata.slot_mapping[keep]] = v[keep]
        out = torch.empty_like(q)
        starts = metadata.query_start_loc_cpu.tolist()
        lengths = metadata.seq_lens_cpu.tolist()
        group = spec.num_heads // spec.num_kv_heads
        for i, seq_len in enumerate(lengths):
            start, end = starts[i], starts[i + 1]
            blocks = metadata.block_table[i, : -(-seq_len // block_size)].long()
            keys = key_cache[blocks].reshape(-1, spec.num_kv_heads, spec.head_size)[:seq_len]
            values = value_cache[blocks].reshape(-1, spec.num_kv_heads, spec.head_size)[:seq_len]
            q_pos = torch.arange(seq_len - (end - start), seq_len).unsqueeze(1)
            k_pos = torch.arange(seq_len).unsqueeze(0)
            mask = k_pos <= q_pos
            query = q[start:end].transpose(0, 1)
            keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)
            values = values.repeat_interleave(group, dim=1).transpose(0, 1)
            out[start:end] = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                                            scale=spec.scale).transpose(0, 1)
        return out


class ToyAttentionBackend(AttentionBackend):
    """Causal paged attention with GQA; no sliding window, no soft-capping (it says so)."""

    name = "TOY_ATTN"
    verification = "example plugin; checked against REFERENCE by the conformance kit on the CPU"
    supported_dtypes = ("float32",)
    supports_sliding_window = False
    supports_logit_softcap = False

    @classmethod
    def impl_cls(cls):
        return ToyAttentionImpl
