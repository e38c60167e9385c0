"""CPU_SIMD paged attention and KV-cache write against REFERENCE, on every ISA path this CPU runs.

Random caches and batches mixing decodes, prefills and chunked prefills over scattered blocks;
float32 and bfloat16; head sizes 64, 80, 128, 256; block sizes 8, 16, 32; GQA ratios 1, 4, 8;
sliding window and logit soft-capping; the split-KV path of few, long sequences.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from dovetail import testing
from dovetail.attention.backend import AttentionLayerSpec
from dovetail.attention.batch import AttentionBatch
from dovetail.attention.reference import ReferenceAttentionImpl, write_kv_cache
from dovetail.errors import ConfigError
from dovetail_cpu import isa, kernels
from dovetail_cpu.attention import CpuSimdBackend, CpuSimdImpl

DTYPES = (torch.float32, torch.bfloat16)
# (head_size, block_size, num_heads, num_kv_heads): each head size, block size and GQA ratio (1, 4, 8) twice.
SHAPES = [(64, 8, 4, 4), (64, 32, 8, 1), (80, 16, 8, 2), (128, 32, 4, 4), (128, 8, 8, 2), (256, 16, 16, 2),
          (80, 8, 8, 1), (256, 32, 2, 2)]


@pytest.fixture(params=isa.ISA_NAMES)
def isa_path(request):
    name = request.param
    if name not in isa.supported_isas():
        pytest.skip(f"this CPU (or build) lacks the {name} path; it runs: {', '.join(isa.supported_isas())}")
    before = isa.selected_isa()
    isa.select_isa(name)
    yield name
    isa.select_isa(before)


def random_batch(seqs, block_size: int, seed: int):
    """``seqs`` of (cached tokens, new tokens), decodes first, over shuffled blocks."""
    rng = random.Random(seed)
    seqs = sorted(seqs, key=lambda s: s[1] != 1)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in seqs]
    batch = AttentionBatch.from_lists([n for _, n in seqs], [c + n for c, n in seqs], tables, block_size)
    return batch, num_blocks


def ragged_seqs(block_size: int, seed: int):
    rng = random.Random(seed)
    decodes = [(rng.randint(1, 90), 1), (block_size, 1), (0, 1)]
    prefills = [(0, rng.randint(20, 45)), (0, 3)]
    chunked = [(rng.randint(5, 40), rng.randint(10, 30)), (2 * block_size, 7)]
    return decodes + prefills + chunked


@functools.lru_cache(maxsize=None)
def reference_case(shape, dtype, seqs, sliding_window, softcap, seed, cache_dtype=None):
    """Random inputs and REFERENCE's output and cache (computed once, shared by every ISA path)."""
    head_size, block_size, num_heads, num_kv_heads = shape
    batch, num_blocks = random_batch(seqs, block_size, seed)
    gen = torch.Generator().manual_seed(seed)
    tokens = batch.num_tokens
    q = torch.randn(tokens, num_heads, head_size, generator=gen).to(dtype)
    k = torch.randn(tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    v = torch.randn(tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(cache_dtype or dtype)
    spec = AttentionLayerSpec(num_heads, num_kv_heads, head_size, head_size ** -0.5, sliding_window, softcap)
    want_cache = cache.clone()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the oracle's many tiny ops only wait on each other with more threads
    try:
        want = ReferenceAttentionImpl(spec).forward(q, k, v, want_cache, batch)
    finally:
        torch.set_num_threads(threads)
    return batch, spec, (q, k, v), cache, want_cache, want


def compare(shape, dtype, seqs, sliding_window=None, softcap=None, seed=0, num_threads=None, cache_dtype=None):
    batch, spec, (q, k, v), cache, want_cache, want = reference_case(
        shape, dtype, tuple(seqs), sliding_window, softcap, seed, cache_dtype)
    cache = cache.clone()
    args = kernels.batch_args(batch.query_start_loc_cpu, batch.seq_lens_cpu, batch.block_table, batch.slot_mapping,
                              batch.block_size, num_threads or torch.get_num_threads())
    got = kernels.paged_attention(args, q, k, v, cache, spec.scale, sliding_window, softcap)
    assert torch.equal(cache, want_cache), "the KV-cache write differs from REFERENCE's"
    assert got.dtype == q.dtype
    exact = dtype == torch.float32 and cache_dtype in (None, torch.float32)
    tol = dict(rtol=1e-5, atol=2e-5) if exact else dict(rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}-b{s[1]}-q{s[2]}kv{s[3]}")
def test_ragged_batch_matches_reference(isa_path, shape, dtype):
    compare(shape, dtype, ragged_seqs(shape[1], seed=shape[0] + shape[1]), seed=shape[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window,softcap", [(8, None), (1, None), (None, 5.0), (13, 2.0)],
                         ids=["window8", "window1", "softcap5", "window13-softcap2"])
def test_sliding_window_and_softcap_match_reference(isa_path, dtype, window, softcap):
    for shape in ((64, 16, 8, 2), (128, 8, 16, 2)):
        compare(shape, dtype, ragged_seqs(shape[1], seed=7), sliding_window=window, softcap=softcap, seed=3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_few_long_sequences_split_across_threads(isa_path, dtype):
    # Fewer (sequence, KV head) items than threads: the kernel splits the keys and merges the parts.
    compare((128, 16, 8, 1), dtype, [(700, 1)], num_threads=4)
    compare((64, 16, 4, 1), dtype, [(600, 1), (530, 2)], sliding_window=300, num_threads=8)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
                         ids=["f32-model-bf16-cache", "bf16-model-f32-cache"])
def test_cache_in_another_dtype(isa_path, dtype, cache_dtype):
    for shape in ((64, 16, 8, 2), (80, 8, 4, 4)):
        compare(shape, dtype, ragged_seqs(shape[1], seed=5), seed=5, cache_dtype=cache_dtype)


def test_long_prefill_over_many_chunks(isa_path):
    compare((64, 16, 8, 2), torch.float32, [(150, 130), (0, 1)], seed=11)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_cache_write_skips_negative_slots(isa_path, dtype):
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 6, 8, 2, 64, generator=gen).to(dtype)
    qkv = torch.randn(5, 8 * 64, generator=gen).to(dtype)
    k = qkv[:, 4 * 64:6 * 64].view(5, 2, 64)  # strided rows, as the model's split gives them
    v = qkv[:, 6 * 64:].view(5, 2, 64)
    slots = torch.tensor([3, -1, 17, 40, -1])
    batch = AttentionBatch.build([5], [5], [[0]], slots.tolist(), 8)
    want = cache.clone()
    write_kv_cache(k, v, want, slots)
    args = kernels.batch_args(batch.query_start_loc_cpu, batch.seq_lens_cpu, batch.block_table, batch.slot_mapping,
                              8, 2)
    kernels.write_kv_cache(args, k, v, cache)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("case", testing.attention_cases(head_sizes=(80,), block_sizes=(8,)), ids=str)
def test_conformance_kit(case):
    testing.check_attention_case(CpuSimdBackend, case)
    testing.check_attention_case(CpuSimdBackend, case, dtype=torch.bfloat16)


def _batch_and_tensors():
    batch, num_blocks = random_batch([(5, 1), (0, 4)], 4, seed=0)
    q = torch.randn(batch.num_tokens, 4, 64)
    k = torch.randn(batch.num_tokens, 2, 64)
    cache = torch.randn(2, num_blocks, 4, 2, 64)
    return batch, q, k, cache


def test_bad_indices_raise_instead_of_reading_out_of_bounds():
    batch, q, k, cache = _batch_and_tensors()
    impl = CpuSimdImpl(AttentionLayerSpec(4, 2, 64, 0.125))
    bad_table = batch.block_table.clone()
    bad_table[0, 0] = cache.shape[1]
    bad = AttentionBatch(**{**batch.__dict__, "block_table": bad_table})
    with pytest.raises(ConfigError, match="block_table"):
        impl.forward(q, k, k, cache, bad)
    bad_slots = batch.slot_mapping.clone()
    bad_slots[-1] = cache.shape[1] * cache.shape[2]
    with pytest.raises(ConfigError, match="slot_mapping"):
        impl.forward(q, k, k, cache, AttentionBatch(**{**batch.__dict__, "slot_mapping": bad_slots}))
    short_seq = batch.seq_lens_cpu.clone()
    short_seq[-1] = 1  # 4 new tokens cannot fit a context of 1
    with pytest.raises(ConfigError, match="query length"):
        impl.forward(q, k, k, cache, AttentionBatch(**{**batch.__dict__, "seq_lens_cpu": short_seq}))


def test_wrong_dtypes_and_layouts_are_named():
    batch, q, k, cache = _batch_and_tensors()
    impl = CpuSimdImpl(AttentionLayerSpec(4, 2, 64, 0.125))
    with pytest.raises(ConfigError, match="^q:"):
        impl.forward(q.half(), k.half(), k.half(), cache.half(), batch)
    with pytest.raises(ConfigError, match="^kv_cache:"):
        impl.forward(q, k, k, cache.half(), batch)
    with pytest.raises(ConfigError, match="^q:.*contiguous"):
        impl.forward(q.transpose(1, 2).contiguous().transpose(1, 2), k, k, cache, batch)


def test_backend_declares_what_it_runs():
    from dovetail.attention.backend import AttentionRequirements

    def req(**kw):
        base = dict(platform="cpu", device_type="cpu", dtype=torch.float32, kv_cache_dtype="auto", block_size=16,
                    head_size=64, num_heads=8, num_kv_heads=2)
        return AttentionRequirements(**{**base, **kw})

    assert CpuSimdBackend.validate(req()) == []
    assert CpuSimdBackend.validate(req(dtype=torch.bfloat16, kv_cache_dtype="bfloat16")) == []
    assert any("head size 72" in r for r in CpuSimdBackend.validate(req(head_size=72)))
    assert any("float16" in r for r in CpuSimdBackend.validate(req(dtype=torch.float16)))
    assert CpuSimdBackend.validate(req(kv_cache_dtype="bfloat16")) == []  # half the cache for a float32 model
    assert any("kv_cache_dtype 'fp8'" in r for r in CpuSimdBackend.validate(req(kv_cache_dtype="fp8")))
    assert "kernel path here: " + isa.selected_isa() in CpuSimdBackend.verification
