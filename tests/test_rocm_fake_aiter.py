"""A stand-in for AMD's ``aiter`` package, so the ROCM_AITER backend can be tested on a CPU.

REAL AITER IS NEVER EXECUTED BY THESE TESTS. The fake has the signatures of the
two public functions the backend calls (``aiter.paged_attention_v1``,
``aiter.flash_attn_varlen_func``), checks its arguments the way aiter's Python
wrappers and kernels need them (read in ROCm/aiter: ``csrc/cpp_itfs/pa/pa_v1.py``,
``csrc/cpp_itfs/pa/pa_kernels.cuh``, ``aiter/ops/mha.py``), records every call,
and computes in float32 with the semantics those sources define. It is written
independently of Dovetail's REFERENCE backend, so comparing the two checks the
backend's layout and metadata translation end to end. The tests in this file
check the fake itself against hand-computed attention.
"""

from __future__ import annotations

import importlib.machinery
import math
import sys
import types

import pytest
import torch

HALF = (torch.float16, torch.bfloat16)
FLT_MAX = torch.finfo(torch.float32).max


class AiterArgumentError(ValueError):
    """An argument aiter would reject, or that its kernel would silently misread."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AiterArgumentError(message)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, logits_mask_then_cap, visible):
    """``q`` [H, D] or [Lq, H, D] against ``keys``/``values`` [Lk, Hkv, D]; float32."""
    group = q.shape[-2] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("...hd,khd->...hk", q.float(), keys)
    scores = logits_mask_then_cap(scores)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("...hk,khd->...hd", probs, values)


class FakeAiter(types.ModuleType):
    """The fake ``aiter`` module; ``calls`` lists ``(function name, arguments)`` in call order."""

    def __init__(self, with_sliding_window: bool = True):
        super().__init__("aiter")
        self.__spec__ = importlib.machinery.ModuleSpec("aiter", loader=None)
        self.calls: list[tuple[str, dict]] = []
        if with_sliding_window:
            self.paged_attention_v1 = self._paged_attention_v1
        else:  # the signature before aiter 0.1.8
            def paged_attention_v1(out, workspace_buffer, query, key_cache, value_cache, scale, block_tables,
                                   cu_query_lens, context_lens, max_context_len, alibi_slopes, kv_cache_dtype,
                                   kv_cache_layout, logits_soft_cap, k_scale, v_scale, fp8_out_scale=None,
                                   partition_size=256, mtp=1):
                return self._paged_attention_v1(out, workspace_buffer, query, key_cache, value_cache, scale,
                                                block_tables, cu_query_lens, context_lens, max_context_len,
                                                alibi_slopes, kv_cache_dtype, kv_cache_layout, logits_soft_cap,
                                                k_scale, v_scale, fp8_out_scale, partition_size, mtp)

            self.paged_attention_v1 = paged_attention_v1

    def _paged_attention_v1(self, out, workspace_buffer, query, key_cache, value_cache, scale, block_tables,
                            cu_query_lens, context_lens, max_context_len, alibi_slopes, kv_cache_dtype,
                            kv_cache_layout, logits_soft_cap, k_scale, v_scale, fp8_out_scale=None,
                            partition_size=256, mtp=1, sliding_window=0):
        self.calls.append(("paged_attention_v1", dict(
            out=out, workspace_buffer=workspace_buffer, query=query, key_cache=key_cache, value_cache=value_cache,
            scale=scale, block_tables=block_tables, cu_query_lens=cu_query_lens, context_lens=context_lens,
            max_context_len=max_context_len, kv_cache_dtype=kv_cache_dtype, kv_cache_layout=kv_cache_layout,
            logits_soft_cap=logits_soft_cap, partition_size=partition_size, sliding_window=sliding_window)))
        _require(kv_cache_dtype == "auto", f"the fake models kv_cache_dtype 'auto' only, got {kv_cache_dtype!r}")
        _require(query.dtype in HALF and out.dtype in HALF, f"Unsupported data type: {query.dtype}/{out.dtype}")
        _require(key_cache.dtype == query.dtype and value_cache.dtype == query.dtype,
                 "with kv_cache_dtype 'auto' the caches must have the query's dtype")
        _require(kv_cache_layout in ("NHD", "HND"), f"unknown kv_cache_layout {kv_cache_layout!r}")
        nhd = kv_cache_layout == "NHD"
        block_size = key_cache.size(1) if nhd else key_cache.size(2)
        num_kv_heads = key_cache.size(2) if nhd else key_cache.size(1)
        num_seqs, num_heads, head_size = block_tables.size(0), query.size(1), query.size(2)
        _require(key_cache.dim() == 4 and value_cache.shape == key_cache.shape, "caches must be 4-D and alike")
        _require(key_cache.size(3) == head_size, "cache head size differs from the query's")
        _require(key_cache.stride(3) == 1 and value_cache.stride() == key_cache.stride(),
                 "the kernel takes one set of block/head/token strides and a contiguous head dimension")
        _require(query.stride(2) == 1 and query.stride(1) == head_size,
                 "the kernel reads query rows at query.stride(0) with heads packed")
        _require(out.is_contiguous(), "out must be contiguous")
        _require(block_tables.dtype == torch.int32 and block_tables.dim() == 2, "block_tables: int32 2-D")
        _require(block_tables.stride() == (block_tables.size(1), 1),
                 "block_tables rows are read with stride max_num_blocks_per_seq = block_tables.size(1)")
        _require(block_tables.size(1) >= math.ceil(max_context_len / block_size), "block_tables too narrow")
        _require(context_lens.dtype == torch.int32 and context_lens.size(0) == num_seqs,
                 "context_lens: int32 with one entry per block-table row")
        _require(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads")
        _require(partition_size % block_size == 0, "partition_size must be a multiple of block_size")
        _require(mtp == 1 and alibi_slopes is None and fp8_out_scale is None, "the fake models mtp=1, no alibi/fp8")
        for name, scale_tensor in (("k_scale", k_scale), ("v_scale", v_scale)):
            _require(isinstance(scale_tensor, torch.Tensor) and scale_tensor.dtype == torch.float32
                     and scale_tensor.numel() >= 1, f"{name} must be a float32 tensor (read through a float*)")
        partitions = math.ceil(max_context_len / partition_size)
        needed = num_seqs * num_heads * partitions * (head_size * query.element_size() + 8)
        _require(workspace_buffer.numel() * workspace_buffer.element_size() >= needed,
                 f"workspace_buffer too small: need {needed} bytes")
        lens = context_lens.tolist()
        _require(min(lens) >= 1 and max(lens) <= max_context_len, "context lengths must lie in [1, max_context_len]")
        rows = list(range(num_seqs))
        if cu_query_lens is not None:
            _require(cu_query_lens.dtype == torch.int32 and cu_query_lens.numel() >= num_seqs + 1,
                     "cu_query_lens: int32 [num_seqs + 1]")
            starts = cu_query_lens.tolist()
            _require(all(starts[i + 1] - starts[i] == 1 for i in range(num_seqs)),
                     "the kernel skips sequences whose query length is not 1")
            rows = starts[:num_seqs]

        def mask_then_cap(scores):
            if sliding_window > 0:  # pa_kernels.cuh: logit := -FLT_MAX where token < context_len - sliding_window
                positions = torch.arange(scores.shape[-1])
                scores = scores.masked_fill(positions < scores.shape[-1] - sliding_window, -FLT_MAX)
            if logits_soft_cap > 0:  # then LogitsTransform soft-caps every logit, masked ones included
                scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
            return scores

        for seq, row in enumerate(rows):
            positions = torch.arange(lens[seq])
            blocks = block_tables[seq, positions // block_size].long()
            offsets = positions % block_size
            keys = key_cache[blocks, offsets] if nhd else key_cache[blocks, :, offsets]
            values = value_cache[blocks, offsets] if nhd else value_cache[blocks, :, offsets]
            visible = torch.ones(num_heads, lens[seq], dtype=torch.bool)
            out[row] = _attend(query[row].float() * scale, keys, values, mask_then_cap, visible).to(out.dtype)
        return out

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               min_seqlen_q=0, dropout_p=0.0, softmax_scale=None, logits_soft_cap=0.0, causal=False,
                               window_size=(-1, -1, 0), bias=None, alibi_slopes=None, deterministic=False,
                               return_lse=False, return_attn_probs=False, how_v3_bf16_cvt=1, block_table=None,
                               out=None, cu_seqlens_q_padded=None, cu_seqlens_k_padded=None, sink_ptr=None):
        self.calls.append(("flash_attn_varlen_func", dict(
            q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, min_seqlen_q=min_seqlen_q, softmax_scale=softmax_scale,
            logits_soft_cap=logits_soft_cap, causal=causal, window_size=window_size)))
        _require(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "q, k, v: [total_tokens, heads, head_dim]")
        _require(q.dtype in HALF and k.dtype == q.dtype and v.dtype == q.dtype, "q, k, v: one half dtype")
        _require(k.shape == v.shape and k.size(2) == q.size(2), "k and v must match q's head dim")
        _require(q.size(1) % k.size(1) == 0, "query heads must be a multiple of KV heads")
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            _require(cu.dtype == torch.int32 and cu.dim() == 1, f"{name}: int32 [batch + 1]")
        _require(cu_seqlens_q.numel() == cu_seqlens_k.numel(), "cu_seqlens_q and cu_seqlens_k: same batch")
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        _require(cq[0] == 0 and ck[0] == 0 and cq[-1] == q.size(0) and ck[-1] == k.size(0),
                 "cumulative lengths must start at 0 and end at the token counts")
        lens_q = [b - a for a, b in zip(cq, cq[1:])]
        lens_k = [b - a for a, b in zip(ck, ck[1:])]
        _require(max(lens_q) <= max_seqlen_q and max(lens_k) <= max_seqlen_k, "max_seqlen_* too small")
        _require(min_seqlen_q <= min(lens_q), "min_seqlen_q larger than a query length")
        _require(dropout_p == 0.0 and bias is None and alibi_slopes is None and block_table is None
                 and not return_lse and not return_attn_probs, "the fake models the plain inference call only")
        scale = softmax_scale if softmax_scale is not None else q.size(2) ** -0.5
        left, right = window_size[0], window_size[1]
        result = torch.empty_like(q)
        for b in range(len(lens_q)):
            qb, kb, vb = q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]
            i = torch.arange(lens_q[b]).view(-1, 1)
            j = torch.arange(lens_k[b]).view(1, -1)
            shift = lens_k[b] - lens_q[b]  # aligned to the bottom-right corner
            visible = torch.ones(lens_q[b], lens_k[b], dtype=torch.bool)
            if causal:
                visible &= j <= i + shift
            if left >= 0:
                visible &= j >= i + shift - left
            if right >= 0:
                visible &= j <= i + shift + right
            def cap(s):
                return logits_soft_cap * torch.tanh(s / logits_soft_cap) if logits_soft_cap > 0 else s

            result[cq[b]:cq[b + 1]] = _attend(qb.float() * scale, kb, vb, cap, visible.unsqueeze(1)).to(q.dtype)
        if out is not None:
            out.copy_(result)
            return out
        return result


def install_fake_aiter(monkeypatch, with_sliding_window: bool = True) -> FakeAiter:
    """Make ``import aiter`` give a :class:`FakeAiter`, on a torch that says it is a ROCm build."""
    fake = FakeAiter(with_sliding_window)
    monkeypatch.setitem(sys.modules, "aiter", fake)
    monkeypatch.setattr(torch.version, "hip", "6.4.43482-fake", raising=False)
    return fake


# -- the fake against hand-computed attention ------------------------------------------------


def _decode_inputs(seed=0, ctx=(5, 19), block_size=16, heads=4, kv_heads=2, head=64):
    gen = torch.Generator().manual_seed(seed)
    blocks = 8
    key_cache = torch.randn(blocks, block_size, kv_heads, head, generator=gen).bfloat16()
    value_cache = torch.randn(blocks, block_size, kv_heads, head, generator=gen).bfloat16()
    tables = torch.tensor([[3, 0], [6, 1]], dtype=torch.int32)
    query = torch.randn(len(ctx), heads, head, generator=gen).bfloat16()
    return query, key_cache, value_cache, tables, torch.tensor(ctx, dtype=torch.int32)


def _call_decode(fake, query, key_cache, value_cache, tables, lens, **kw):
    out = torch.empty_like(query)
    workspace = torch.empty(1 << 16, dtype=torch.uint8)
    one = torch.ones(1)
    fake.paged_attention_v1(out, workspace, query, key_cache, value_cache, 0.125, tables, None, lens, int(lens.max()),
                            None, "auto", "NHD", kw.pop("cap", 0.0), one, one, None, 256, 1, **kw)
    return out


def _by_hand(query, key_cache, value_cache, tables, lens, window=None, cap=None):
    outs = []
    for s in range(len(lens)):
        n = int(lens[s])
        keys = torch.cat([key_cache[b] for b in tables[s].tolist()])[:n].float()  # [n, kvh, D]
        values = torch.cat([value_cache[b] for b in tables[s].tolist()])[:n].float()
        rows = []
        for h in range(query.shape[1]):
            kv = h // (query.shape[1] // keys.shape[1])
            scores = 0.125 * keys[:, kv] @ query[s, h].float()
            if cap:
                scores = cap * torch.tanh(scores / cap)
            if window:
                scores[: n - window] = float("-inf")
            rows.append(torch.softmax(scores, 0) @ values[:, kv])
        outs.append(torch.stack(rows))
    return torch.stack(outs)


def test_fake_paged_decode_matches_attention_computed_by_hand():
    fake = FakeAiter()
    inputs = _decode_inputs()
    out = _call_decode(fake, *inputs)
    assert torch.allclose(out.float(), _by_hand(*inputs), atol=2e-2)
    windowed = _call_decode(fake, *inputs, sliding_window=4)
    assert torch.allclose(windowed.float(), _by_hand(*inputs, window=4), atol=2e-2)
    assert not torch.allclose(windowed.float(), out.float(), atol=2e-2)


def test_fake_reproduces_the_kernel_soft_capping_masked_logits():
    """With a window and a soft cap, aiter's decode kernel gives masked keys the logit -cap (why
    ROCM_AITER refuses that combination); the fake reproduces it, so it differs from true masking."""
    fake = FakeAiter()
    inputs = _decode_inputs()
    out = _call_decode(fake, *inputs, sliding_window=4, cap=2.0)
    assert not torch.allclose(out.float(), _by_hand(*inputs, window=4, cap=2.0), atol=2e-2)


def test_fake_rejects_what_aiter_would_misread():
    fake = FakeAiter()
    query, key_cache, value_cache, tables, lens = _decode_inputs()
    with pytest.raises(AiterArgumentError, match="int32"):
        _call_decode(fake, query, key_cache, value_cache, tables.long(), lens)
    with pytest.raises(AiterArgumentError, match="Unsupported data type"):
        _call_decode(fake, query.float(), key_cache.float(), value_cache.float(), tables, lens)
    with pytest.raises(AiterArgumentError, match="workspace"):
        out = torch.empty_like(query)
        fake.paged_attention_v1(out, torch.empty(8, dtype=torch.uint8), query, key_cache, value_cache, 0.1, tables,
                                None, lens, int(lens.max()), None, "auto", "NHD", 0.0, torch.ones(1), torch.ones(1))


def test_fake_varlen_prefill_aligns_causal_mask_bottom_right():
    fake = FakeAiter()
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, 64, generator=gen).half()
    k = torch.randn(5, 1, 64, generator=gen).half()
    v = torch.randn(5, 1, 64, generator=gen).half()
    cu_q, cu_k = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
    out = fake.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2, 5, softmax_scale=0.125, causal=True)
    # documented example: seqlen_q 2, seqlen_k 5 -> row 0 sees keys 0..3, row 1 sees keys 0..4
    for row, seen in ((0, 4), (1, 5)):
        for h in range(2):
            probs = torch.softmax(0.125 * k[:seen, 0].float() @ q[row, h].float(), 0)
            assert torch.allclose(out[row, h].float(), probs @ v[:seen, 0].float(), atol=1e-2)
