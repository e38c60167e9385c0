"""TRITON kernels compiled on a real GPU: model-sized shapes, half precision, CUDA graphs.

All marked ``gpu`` (skipped without CUDA). Run on the H200 with
``pytest -m gpu tests/test_triton_gpu.py``. The interpreter tests
(``test_triton_attention.py``, ``test_triton_fused_ops.py``) also run their tiny
cases compiled on the GPU when one is present.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu

HALF = [torch.bfloat16, torch.float16]


def _cuda_ready():
    from dovetail.triton import interpreter_active

    if interpreter_active():
        pytest.skip("TRITON_INTERPRET=1 is set in this process; run this file on its own")


@pytest.fixture(autouse=True)
def compiled_triton():
    pytest.importorskip("triton")
    _cuda_ready()


def paged_case(seqs, num_heads, num_kv_heads, head_size, block_size, dtype, seed=0):
    """Random q/k/v, a random cache and a batch; ``seqs`` is (cached, new) per sequence, decodes first."""
    from dovetail.attention.batch import AttentionBatch

    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    seqs = sorted(seqs, key=lambda s: s[1] != 1)
    needed = [-(-(c + n) // block_size) for c, n in seqs]
    blocks = list(range(sum(needed) + 4))
    rng.shuffle(blocks)
    tables = []
    for n in needed:
        tables.append([blocks.pop() for _ in range(n)])
    batch = AttentionBatch.from_lists([n for _, n in seqs], [c + n for c, n in seqs], tables, block_size, "cuda")
    tokens = batch.num_tokens

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    cache = rand(2, sum(needed) + 4, block_size, num_kv_heads, head_size)
    return rand(tokens, num_heads, head_size), rand(tokens, num_kv_heads, head_size), \
        rand(tokens, num_kv_heads, head_size), cache, batch


def compare(case, spec, atol):
    from dovetail.attention.reference import ReferenceAttentionImpl
    from dovetail.attention.triton_backend import TritonAttentionImpl

    q, k, v, cache, batch = case
    ref_cache, tri_cache = cache.clone(), cache.clone()
    expected = ReferenceAttentionImpl(spec).forward(q, k, v, ref_cache, batch)
    actual = TritonAttentionImpl(spec).forward(q, k, v, tri_cache, batch)
    torch.cuda.synchronize()
    assert torch.equal(tri_cache, ref_cache)
    diff = (actual.float() - expected.float()).abs().max().item()
    assert diff <= atol, f"TRITON differs from REFERENCE by {diff:.3g} (tolerance {atol})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
def test_conformance_kit_on_gpu(head_size, dtype):
    from dovetail import testing
    from dovetail.attention.triton_backend import TritonBackend

    for case in testing.attention_cases(head_sizes=(head_size,), block_sizes=(16, 32)):
        testing.check_attention_case(TritonBackend, case, device="cuda", dtype=dtype, platform="cuda")


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 8), (32, 8), (32, 32)])
def test_model_sized_mixed_batch(num_heads, num_kv_heads, dtype):
    from dovetail.attention.backend import AttentionLayerSpec

    seqs = [(random.Random(i).randint(1, 2000), 1) for i in range(48)] + [(0, 700), (300, 512), (1500, 97)]
    case = paged_case(seqs, num_heads, num_kv_heads, 128, 16, dtype)
    compare(case, AttentionLayerSpec(num_heads, num_kv_heads, 128, 128 ** -0.5), atol=2e-2)


@pytest.mark.parametrize("dtype", HALF)
def test_gemma2_like_window_and_softcap(dtype):
    from dovetail.attention.backend import AttentionLayerSpec

    seqs = [(900, 1), (40, 1), (0, 600), (700, 300)]
    case = paged_case(seqs, 8, 4, 256, 16, dtype, seed=1)
    spec = AttentionLayerSpec(8, 4, 256, 256 ** -0.5, sliding_window=256, logit_softcap=50.0)
    compare(case, spec, atol=2e-2)


@pytest.mark.parametrize("context", [16, 8191, 32768])
def test_batch1_long_decode_uses_splits(context):
    from dovetail.attention.backend import AttentionLayerSpec
    from dovetail.triton.paged_attention import default_num_splits

    assert default_num_splits(1, 8, torch.device("cuda")) > 1
    case = paged_case([(context, 1)], 32, 8, 128, 16, torch.bfloat16, seed=2)
    compare(case, AttentionLayerSpec(32, 8, 128, 128 ** -0.5), atol=2e-2)


def test_decode_replays_in_a_cuda_graph():
    """Captured once, replayed with new lengths, tables, slots and inputs: still equal to REFERENCE."""
    from dovetail.attention.backend import AttentionLayerSpec
    from dovetail.attention.reference import ReferenceAttentionImpl
    from dovetail.attention.triton_backend import TritonAttentionImpl, TritonBackend, TritonMetadataBuilder

    spec = AttentionLayerSpec(16, 8, 128, 128 ** -0.5)
    q, k, v, cache, batch = paged_case([(100, 1), (33, 1), (250, 1), (7, 1)], 16, 8, 128, 16, torch.bfloat16)
    impl = TritonAttentionImpl(spec)
    builder = TritonMetadataBuilder(TritonBackend, [spec], 16, torch.device("cuda"), torch.bfloat16)
    metadata = builder.build_for_graph(batch, 4)  # the decodes longest first, from a buffer the graph reads
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        impl.forward(q, k, v, cache, metadata)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = impl.forward(q, k, v, cache, metadata)
    # A later step: the same four sequences one token further, written into the static buffers.
    for static in (q, k, v):
        static.copy_(torch.randn_like(static))
    new_lens = batch.seq_lens + 1
    last = new_lens.long() - 1
    slots = batch.block_table.gather(1, (last // 16).view(-1, 1)).view(-1).long() * 16 + last % 16
    batch.seq_lens.copy_(new_lens)
    batch.slot_mapping.copy_(slots)
    batch.seq_lens_cpu.copy_(new_lens.cpu())
    builder.build_for_graph(batch, 4)
    expected_cache = cache.clone()
    expected = ReferenceAttentionImpl(spec).forward(q, k, v, expected_cache, batch)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(cache, expected_cache)
    assert (out.float() - expected.float()).abs().max().item() <= 2e-2


def test_mixed_steps_compile_nothing_beyond_start_up():
    """Per-step values are runtime arguments. Once the kinds of step that the engine runs at start-up have
    compiled their launches (a prefill-only step in the profiling run; small and large decode-only steps in
    graph capture), steps mixing any number of decodes with prefills reuse them. A prefill launch after an
    odd number of decodes once compiled a variant of its own (a placeholder pointer at ``seq_lens[n:]``)."""
    from dovetail.attention.backend import AttentionLayerSpec
    from dovetail.attention.triton_backend import TritonAttentionImpl
    from dovetail.triton import paged_attention

    spec = AttentionLayerSpec(32, 8, 128, 128 ** -0.5)
    impl = TritonAttentionImpl(spec)

    from dovetail import testing
    from dovetail.attention.backend import RotaryInputs
    from dovetail.layers.rotary import compute_cos_sin_cache
    from dovetail.triton import kv_cache_write, rotary

    table = compute_cos_sin_cache(128, 4096, {"rope_theta": 500000.0, "rope_type": "default"}, 4096).cuda()

    def compiled():
        kernels = (paged_attention._paged_attention_kernel, paged_attention._reduce_splits_kernel,
                   rotary._rotary_kernel, kv_cache_write._kv_cache_write_kernel)
        return sum(len(entry[0]) for kernel in kernels for entry in kernel.device_caches.values())

    def step(seed, decodes, prefill):
        """The step once without rotary (``forward``) and once as the models call it (``forward_rotary``)."""
        seqs = [(random.Random(seed + i).randint(1, 3000), 1) for i in range(decodes)] + prefill
        q, k, v, cache, batch = paged_case(seqs, 32, 8, 128, 16, torch.bfloat16, seed=seed)
        impl.forward(q, k, v, cache, batch)
        positions = testing.row_positions(batch, "cuda")
        apply = lambda pos, q2, k2: rotary.rotary_embedding(pos, q2, k2, table, 128, 128)  # noqa: E731
        impl.forward_rotary(q, k, v, cache, batch, RotaryInputs(positions, table, 128, apply))

    for seed, decodes in enumerate((1, 2, 8, 24, 200)):  # each split count, then unsplit
        step(seed, decodes, [])
    step(10, 0, [(0, 100), (17, 300)])
    torch.cuda.synchronize()
    before = compiled()
    for seed, decodes, prefill in [(20, 1, [(5, 2)]), (21, 3, [(0, 100)]), (22, 17, [(40, 7)]),
                                   (23, 27, [(0, 500), (3, 1)]), (24, 201, [(1000, 16), (0, 1)])]:
        step(seed, decodes, prefill)
    torch.cuda.synchronize()
    assert compiled() == before


@pytest.mark.parametrize("dtype", HALF + [torch.float32])
def test_fused_ops_conformance_on_gpu(dtype):
    from dovetail import testing
    from dovetail.triton.fused_ops import GEMV_MAX_ROWS, TritonFusedOps

    testing.check_fused_ops(TritonFusedOps(gemv_max_rows=GEMV_MAX_ROWS, gated_gemv_max_rows=64), "cuda", dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_fused_ops_at_llama_8b_sizes(dtype):
    from dovetail.layers.rotary import compute_cos_sin_cache
    from dovetail.ops import FusedOps
    from dovetail.triton.fused_ops import TritonFusedOps

    ref, tri = FusedOps(), TritonFusedOps()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    def close(a, b):
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * max(1.0, b.float().abs().max().item())

    x, residual, weight = rand(3000, 4096), rand(3000, 4096), rand(4096)
    close(tri.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5))
    for got, want in zip(tri.add_rms_norm(x, residual, weight, 1e-5), ref.add_rms_norm(x, residual, weight, 1e-5)):
        close(got, want)
    gate_up = rand(3000, 2 * 14336)
    close(tri.silu_and_mul(gate_up), ref.silu_and_mul(gate_up))
    params = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cos_sin = compute_cos_sin_cache(128, 131072, params, 131072).cuda()
    qkv = rand(3000, (32 + 16) * 128)
    q, k = qkv[:, :4096], qkv[:, 4096:5120]
    positions = torch.randint(0, 131072, (3000,), generator=gen, device="cuda")
    for got, want in zip(tri.rotary_embedding(positions, q, k, cos_sin, 128, 128),
                         ref.rotary_embedding(positions, q, k, cos_sin, 128, 128)):
        close(got, want)


def test_sliced_index_arrays_do_not_recompile():
    """``slot_mapping[n:]`` and ``positions[n:]`` start at any 8-byte offset: the cache write and the rotary
    kernel are not specialised on those pointers' alignment, so an odd offset compiles nothing new."""
    from dovetail.layers.rotary import compute_cos_sin_cache
    from dovetail.triton import kv_cache_write, rotary

    def compiled(kernel):
        return sum(len(entry[0]) for entry in kernel.device_caches.values())

    k = torch.randn(9, 8, 128, device="cuda", dtype=torch.bfloat16)
    cache = torch.zeros(2, 4, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(9, device="cuda")
    q2, k2 = torch.randn(9, 32 * 128, device="cuda", dtype=torch.bfloat16), k.flatten(1)
    positions = torch.arange(9, device="cuda")
    table = compute_cos_sin_cache(128, 64, {"rope_theta": 10000.0, "rope_type": "default"}, 64).cuda()
    kv_cache_write.write_kv_cache(k[2:], k[2:], cache, slots[2:])
    rotary.rotary_embedding(positions[2:], q2[2:], k2[2:], table, 128, 128)
    before = compiled(kv_cache_write._kv_cache_write_kernel), compiled(rotary._rotary_kernel)
    kv_cache_write.write_kv_cache(k[1:], k[1:], cache, slots[1:])
    rotary.rotary_embedding(positions[1:], q2[1:], k2[1:], table, 128, 128)
    torch.cuda.synchronize()
    assert (compiled(kv_cache_write._kv_cache_write_kernel), compiled(rotary._rotary_kernel)) == before
