"""Attention backends against REFERENCE on random inputs: prefill, decode, chunked prefill, GQA, and q and k
handed over before their rotary embedding (``AttentionImpl.forward_rotary``)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from dovetail.attention.backend import AttentionBackend, AttentionLayerSpec, AttentionRequirements, RotaryInputs
from dovetail.attention.batch import AttentionBatch
from dovetail.attention.reference import ReferenceBackend
from dovetail.layers.rotary import compute_cos_sin_cache
from dovetail.ops import FusedOps


class NotApplicable(Exception):
    """The backend declares (through ``validate``) that it does not support this case."""


@dataclass(frozen=True)
class AttentionCase:
    """One batch shape: per sequence, (tokens already cached, new tokens)."""

    name: str
    seqs: tuple[tuple[int, int], ...]
    head_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 4
    block_size: int = 16
    sliding_window: int | None = None
    logit_softcap: float | None = None
    #: q and k go in before their rotary embedding (``forward_rotary``), after per-head norms with ``"qk_norm"``.
    rotary: str | None = None

    def __str__(self):
        return self.name


def attention_cases(head_sizes=(64, 128), block_sizes=(16,)) -> list[AttentionCase]:
    """The standard cases: prefill, decode, chunked prefill, a ragged mix, GQA, window, soft-capping."""
    cases = []
    for hs in head_sizes:
        for bs in block_sizes:
            tag = f"h{hs}-b{bs}"
            cases += [
                AttentionCase(f"prefill-{tag}", ((0, 37), (0, 5)), hs, 4, 4, bs),
                AttentionCase(f"decode-{tag}", ((40, 1), (3, 1), (bs, 1)), hs, 4, 4, bs),
                AttentionCase(f"chunked-prefill-{tag}", ((21, 19), (bs * 2, 7)), hs, 4, 4, bs),
                AttentionCase(f"mixed-{tag}", ((30, 1), (9, 1), (0, 13), (17, 24)), hs, 4, 4, bs),
                AttentionCase(f"gqa4-{tag}", ((25, 1), (0, 29), (12, 9)), hs, 8, 2, bs),
            ]
    cases += [
        AttentionCase("gqa8-mixed", ((50, 1), (0, 20), (10, 6)), 64, 8, 1, 16),
        AttentionCase("sliding-window", ((45, 1), (0, 40), (20, 15)), 64, 4, 2, 16, sliding_window=8),
        AttentionCase("softcap", ((33, 1), (0, 18), (8, 8)), 64, 4, 2, 16, logit_softcap=5.0),
        AttentionCase("rotary-mixed", ((30, 1), (9, 1), (0, 13), (17, 6)), 64, 8, 2, 16, rotary="rotary"),
        AttentionCase("qk-norm-rotary-decode", ((41, 1), (2, 1), (15, 1)), 64, 4, 2, 16, rotary="qk_norm"),
    ]
    return cases


def row_positions(batch: AttentionBatch, device: str | torch.device) -> torch.Tensor:
    """The position of every query row of ``batch`` (a sequence's new tokens come last in it), on ``device``:
    what the model runner hands the rotary embedding."""
    qsl, seq_lens = batch.query_start_loc_cpu.tolist(), batch.seq_lens_cpu.tolist()
    return torch.tensor([p for i, s in enumerate(seq_lens) for p in range(s - (qsl[i + 1] - qsl[i]), s)],
                        device=device)


def _rotary_inputs(case: AttentionCase, batch: AttentionBatch, device: str, dtype: torch.dtype) -> RotaryInputs:
    """Every row's position, a cos/sin table and (``qk_norm``) random norm weights; ``apply`` is the definition."""
    ops = FusedOps()
    seq_lens = batch.seq_lens_cpu.tolist()
    positions = row_positions(batch, device)
    table = compute_cos_sin_cache(case.head_size, max(seq_lens) + 1, {"rope_theta": 500.0, "rope_type": "default"},
                                  max(seq_lens) + 1).to(device)
    if case.rotary != "qk_norm":
        return RotaryInputs(positions, table, case.head_size,
                            lambda pos, q, k: ops.rotary_embedding(pos, q, k, table, case.head_size, case.head_size))
    q_weight, k_weight = (1 + 0.3 * torch.randn(2, case.head_size, device=device)).to(dtype)
    return RotaryInputs(positions, table, case.head_size, lambda pos, q, k: ops.qk_norm_rotary_embedding(
        pos, q, k, q_weight, k_weight, 1e-6, table, case.head_size, case.head_size), q_weight, k_weight, 1e-6)


def _requirements(backend: type[AttentionBackend], case: AttentionCase, device: str, dtype: torch.dtype,
                  platform: str):
    return AttentionRequirements(
        platform=platform, device_type=torch.device(device).type, dtype=dtype, kv_cache_dtype="auto",
        block_size=case.block_size, head_size=case.head_size, num_heads=case.num_heads,
        num_kv_heads=case.num_kv_heads, uses_sliding_window=case.sliding_window is not None,
        uses_logit_softcap=case.logit_softcap is not None)


def _random_batch(case: AttentionCase, device: str, seed: int):
    rng = random.Random(seed)
    tables, seq_lens, query_lens = [], [], []
    total_blocks = sum(-(-(c + n) // case.block_size) for c, n in case.seqs) + 3
    free = list(range(total_blocks))
    rng.shuffle(free)  # scattered, non-contiguous blocks
    order = sorted(case.seqs, key=lambda s: s[1] != 1)  # decodes first, as the engine orders them
    for cached, new in order:
        need = -(-(cached + new) // case.block_size)
        tables.append([free.pop() for _ in range(need)])
        seq_lens.append(cached + new)
        query_lens.append(new)
    batch = AttentionBatch.from_lists(query_lens, seq_lens, tables, case.block_size, device)
    return batch, total_blocks


def check_attention_case(backend: type[AttentionBackend], case: AttentionCase, device: str = "cpu",
                         dtype: torch.dtype = torch.float32, platform: str = "cpu", atol: float | None = None,
                         seed: int = 0) -> None:
    """Run ``backend`` and REFERENCE on the same random cache and batch; outputs and caches must agree."""
    reasons = backend.validate(_requirements(backend, case, device, dtype, platform))
    if reasons:
        raise NotApplicable("; ".join(reasons))
    torch.manual_seed(seed)
    batch, num_blocks = _random_batch(case, device, seed)
    spec = AttentionLayerSpec(case.num_heads, case.num_kv_heads, case.head_size, case.head_size ** -0.5,
                              case.sliding_window, case.logit_softcap)
    tokens = batch.num_tokens
    q = torch.randn(tokens, case.num_heads, case.head_size, device=device).to(dtype)
    k = torch.randn(tokens, case.num_kv_heads, case.head_size, device=device).to(dtype)
    v = torch.randn(tokens, case.num_kv_heads, case.head_size, device=device).to(dtype)
    ref_shape = ReferenceBackend.kv_cache_shape(num_blocks, case.block_size, case.num_kv_heads, case.head_size)
    ref_cache = torch.randn(ref_shape, device=device).to(dtype)  # the cached context: random, never zeros
    rotary = _rotary_inputs(case, batch, device, dtype) if case.rotary else None

    def attend(impl, cache, metadata):
        if rotary is None:
            return impl.forward(q, k, v, cache, metadata)
        return impl.forward_rotary(q, k, v, cache, metadata, rotary)

    ref_out = attend(ReferenceBackend.impl_cls()(spec), ref_cache.clone(), batch)

    shape = backend.kv_cache_shape(num_blocks, case.block_size, case.num_kv_heads, case.head_size)
    cache = backend.cache_from_reference(ref_cache)
    assert tuple(cache.shape) == tuple(shape), (
        f"{backend.name}.cache_from_reference gave shape {tuple(cache.shape)}, kv_cache_shape says {tuple(shape)}")
    builder = backend.metadata_builder_cls()(backend, [spec], case.block_size, torch.device(device), dtype)
    out = attend(backend.impl_cls()(spec), cache, builder.build(batch))
    tol = atol if atol is not None else (2e-3 if dtype == torch.float32 else 3e-2)
    diff = (out.float() - ref_out.float()).abs().max().item()
    assert diff <= tol, f"{backend.name} output differs from REFERENCE by {diff:.3g} (tolerance {tol}) in {case}"
    written = batch.slot_mapping.long()
    ours = backend.cache_to_reference(cache).reshape(2, -1, case.num_kv_heads, case.head_size)[:, written].float()
    stored_k = k if rotary is None else rotary.apply(rotary.positions, q.flatten(1), k.flatten(1))[1].view(k.shape)
    want = torch.stack([stored_k, v]).float()
    wdiff = (ours - want).abs().max().item()
    if rotary is not None:  # a kernel may round the rotation once where the definition rounds each product
        wtol = 2 * torch.finfo(dtype).eps * max(1.0, want.abs().max().item())
    else:
        wtol = 0 if dtype == torch.float32 else 1e-2
    assert wdiff <= wtol, \
        f"{backend.name} wrote keys/values that differ by {wdiff:.3g} from the inputs in {case}"
