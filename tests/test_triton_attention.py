"""TRITON attention and the KV-cache write against REFERENCE, on random inputs (never zeros).

Without a GPU the kernels run in triton's CPU interpreter, which must be switched
on before triton is first imported: this module sets ``TRITON_INTERPRET=1`` when
it is collected. With a GPU the same tests run the compiled kernels on it.
Shapes are tiny: the interpreter runs every program in numpy.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from dovetail import testing  # noqa: E402
from dovetail.attention.backend import AttentionLayerSpec, AttentionRequirements  # noqa: E402
from dovetail.attention.batch import AttentionBatch  # noqa: E402
from dovetail.attention.reference import ReferenceAttentionImpl, write_kv_cache  # noqa: E402
from dovetail.attention.triton_backend import TritonAttentionImpl, TritonBackend  # noqa: E402

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


@pytest.fixture(scope="module", autouse=True)
def kernels_can_run_here():
    from dovetail.triton import interpreter_active

    if DEVICE == "cpu" and not interpreter_active():
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run on "
                    "the CPU in this process; something collected earlier imports triton at import time")


def make_case(query_lens, seq_lens, *, num_heads=4, num_kv_heads=2, head_size=32, block_size=4,
              dtype=torch.float32, seed=0, spare_blocks=3):
    """Random q/k/v, a random cache and a batch whose block tables are shuffled block numbers."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(order[used:used + n])
        used += n
    batch = AttentionBatch.from_lists(query_lens, seq_lens, tables, block_size, DEVICE)
    tokens = sum(query_lens)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)

    q, k, v = rand(tokens, num_heads, head_size), rand(tokens, num_kv_heads, head_size), rand(tokens, num_kv_heads, head_size)
    cache = rand(2, num_blocks, block_size, num_kv_heads, head_size)
    return q, k, v, cache, batch


class _FusedTriton(TritonAttentionImpl):
    """TRITON with the decode launch writing the decodes' keys and values whatever the batch's size."""

    def _fuses_into_decode_launch(self, num_decodes, q):
        return num_decodes > 0


class _UnfusedTriton(TritonAttentionImpl):
    """TRITON with the cache write always launched first."""

    def _fuses_into_decode_launch(self, num_decodes, q):
        return False


def run_both(case, spec, impl_cls=TritonAttentionImpl):
    """Output and cache of REFERENCE and of TRITON on copies of the same inputs."""
    q, k, v, cache, batch = case
    ref_cache, tri_cache = cache.clone(), cache.clone()
    expected = ReferenceAttentionImpl(spec).forward(q, k, v, ref_cache, batch)
    actual = impl_cls(spec).forward(q, k, v, tri_cache, batch)
    return expected, actual, ref_cache, tri_cache


def check(case, spec):
    """Both ways of writing the decodes' keys and values (in the decode launch or before it)."""
    for impl_cls in (_FusedTriton, _UnfusedTriton):
        expected, actual, ref_cache, tri_cache = run_both(case, spec, impl_cls)
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        torch.testing.assert_close(tri_cache, ref_cache, rtol=0, atol=0)
        torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[expected.dtype])


def spec_for(case, scale=None, sliding_window=None, logit_softcap=None):
    q, k = case[0], case[1]
    head_size = q.shape[-1]
    return AttentionLayerSpec(num_heads=q.shape[1], num_kv_heads=k.shape[1], head_size=head_size,
                              scale=scale if scale is not None else head_size ** -0.5,
                              sliding_window=sliding_window, logit_softcap=logit_softcap)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2)])
def test_prefill(num_heads, num_kv_heads):
    case = make_case([5, 11], [5, 11], num_heads=num_heads, num_kv_heads=num_kv_heads)
    check(case, spec_for(case))


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2)])
def test_chunked_prefill_reads_context_from_cache(num_heads, num_kv_heads):
    case = make_case([3, 6], [10, 7], num_heads=num_heads, num_kv_heads=num_kv_heads, seed=1)
    check(case, spec_for(case))


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2)])
def test_decode(num_heads, num_kv_heads):
    case = make_case([1, 1, 1], [1, 9, 18], num_heads=num_heads, num_kv_heads=num_kv_heads, seed=2)
    check(case, spec_for(case))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_ragged_mixed_batch(dtype):
    case = make_case([1, 1, 4, 1, 7], [6, 13, 9, 2, 7], num_heads=4, num_kv_heads=1, dtype=dtype, seed=3)
    check(case, spec_for(case))


@pytest.mark.parametrize("head_size,block_size", [(64, 16), (80, 1), (128, 8), (256, 128)])
def test_head_and_block_sizes(head_size, block_size):
    case = make_case([1, 3], [5, 6], num_heads=2, num_kv_heads=1, head_size=head_size,
                     block_size=block_size, seed=4)
    check(case, spec_for(case))


@pytest.mark.parametrize("window", [1, 4])
def test_sliding_window(window):
    case = make_case([1, 6, 9], [12, 14, 9], num_heads=4, num_kv_heads=2, seed=5)
    check(case, spec_for(case, sliding_window=window))


def test_logit_softcap_changes_and_matches():
    case = make_case([1, 7], [9, 12], num_heads=4, num_kv_heads=2, seed=6)
    capped = spec_for(case, scale=1.0, logit_softcap=2.0)
    check(case, capped)
    expected_capped = run_both(case, capped)[1]
    uncapped = run_both(case, spec_for(case, scale=1.0))[1]
    assert not torch.allclose(expected_capped, uncapped, atol=1e-3)


def test_window_and_softcap_together_in_bfloat16():
    case = make_case([1, 5], [11, 13], num_heads=4, num_kv_heads=1, dtype=torch.bfloat16, seed=7)
    check(case, spec_for(case, sliding_window=3, logit_softcap=5.0))


def test_negative_slots_are_not_written():
    query_lens, seq_lens, block_size = [1, 4], [7, 4], 4
    q, k, v, cache, batch = make_case(query_lens, seq_lens, seed=8)
    slots = batch.slot_mapping.tolist()
    skipped, written = [slots[0], slots[3]], [slots[1], slots[4]]
    slots[0] = slots[3] = -1
    tables = [row[: -(-s // block_size)] for row, s in zip(batch.block_table.tolist(), seq_lens)]
    batch = AttentionBatch.build(query_lens, seq_lens, tables, slots, block_size, DEVICE)
    expected, actual, ref_cache, tri_cache = run_both((q, k, v, cache, batch), spec_for((q, k)), _FusedTriton)
    torch.testing.assert_close(tri_cache, ref_cache, rtol=0, atol=0)
    # Row 0, a decode that stores nothing, has no specified output (REFERENCE reads the stale slot back,
    # TRITON's decode launch attends the new key); the prefill's rows read the stale slot in both.
    torch.testing.assert_close(actual[1:], expected[1:], **TOLERANCE[torch.float32])
    keys, old_keys = tri_cache[0].flatten(0, 1), cache[0].flatten(0, 1)
    assert all(torch.equal(keys[s], old_keys[s]) for s in skipped)
    assert torch.equal(keys[written[0]], k[1]) and torch.equal(keys[written[1]], k[4])


def test_kv_cache_write_matches_reference_with_padding():
    from dovetail.triton.kv_cache_write import write_kv_cache as triton_write

    gen = torch.Generator().manual_seed(9)
    k = torch.randn(6, 3, 40, generator=gen).half().to(DEVICE)
    v = torch.randn(6, 3, 40, generator=gen).half().to(DEVICE)
    cache = torch.randn(2, 5, 4, 3, 40, generator=gen).half().to(DEVICE)
    slots = torch.tensor([17, -1, 0, 5, -1, 19], device=DEVICE)
    expected, actual = cache.clone(), cache.clone()
    write_kv_cache(k, v, expected, slots)
    triton_write(k, v, actual, slots)
    assert torch.equal(actual, expected)
    assert not torch.equal(actual, cache)


def test_kv_cache_write_accepts_strided_keys():
    from dovetail.triton.kv_cache_write import write_kv_cache as triton_write

    gen = torch.Generator().manual_seed(10)
    qkv = torch.randn(3, (4 + 2 + 2) * 16, generator=gen).to(DEVICE)
    k = qkv[:, 64:96].view(3, 2, 16)
    v = qkv[:, 96:].view(3, 2, 16)
    cache = torch.randn(2, 2, 4, 2, 16, generator=gen).to(DEVICE)
    slots = torch.tensor([6, 1, 3], device=DEVICE)
    expected, actual = cache.clone(), cache.clone()
    write_kv_cache(k, v, expected, slots)
    triton_write(k, v, actual, slots)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_kernel_tiles_splits_and_window_skipping(num_splits):
    """Small key tiles so that windows skip whole tiles, with and without KV splits."""
    from dovetail.triton.paged_attention import LaunchConfig, paged_attention

    case = make_case([1, 1, 5], [40, 3, 37], num_heads=4, num_kv_heads=2, seed=11)
    q, k, v, cache, batch = case
    spec = spec_for(case, sliding_window=6)
    ref_cache = cache.clone()
    expected = ReferenceAttentionImpl(spec).forward(q, k, v, ref_cache, batch)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, ref_cache[0], ref_cache[1], out, batch.block_table, batch.seq_lens, batch.query_start_loc,
                    num_tokens=batch.num_tokens, num_seqs=batch.num_seqs, scale=spec.scale, sliding_window=6,
                    num_splits=num_splits, config=LaunchConfig(block_m=16, tile_n=16, num_warps=4, num_stages=1))
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


def test_decode_split_path_matches():
    """The backend's decode launch splits small batches; force both splits and none."""
    from dovetail.triton.paged_attention import paged_attention

    case = make_case([1, 1], [30, 17], num_heads=4, num_kv_heads=2, seed=12)
    q, k, v, cache, batch = case
    spec = spec_for(case)
    ref_cache = cache.clone()
    expected = ReferenceAttentionImpl(spec).forward(q, k, v, ref_cache, batch)
    for splits in (1, 2, 16):
        out = torch.full_like(q, float("nan"))
        paged_attention(q, ref_cache[0], ref_cache[1], out, batch.block_table, batch.seq_lens,
                        batch.query_start_loc, num_tokens=2, num_seqs=2, scale=spec.scale, decode=True,
                        num_splits=splits)
        torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_launch_stores_and_attends_its_own_keys(dtype):
    """With ``new_kv`` the decode launch attends each decode's new key and value from ``k`` and ``v`` (the
    cache's slot still holds garbage: NaN here) and stores them there, split or not, windowed or not (every window
    and every split count, not every pair of them: the interpreter takes seconds a launch)."""
    from dovetail.triton.paged_attention import LaunchConfig, paged_attention

    case = make_case([1, 1, 1], [1, 30, 17], num_heads=4, num_kv_heads=2, dtype=dtype, seed=15)
    q, k, v, cache, batch = case
    for window, split_counts in ((None, (1, 2)), (1, (2,)), (5, (16,))):
        spec = spec_for(case, sliding_window=window)
        ref_cache = cache.clone()
        expected = ReferenceAttentionImpl(spec).forward(q, k, v, ref_cache, batch)
        for splits in split_counts:
            tri_cache = cache.clone()
            tri_cache.view(2, -1, *cache.shape[-2:])[:, batch.slot_mapping] = float("nan")
            out = torch.full_like(q, float("nan"))
            config = LaunchConfig(block_m=16, tile_n=16, num_warps=4, num_stages=1)
            paged_attention(q, tri_cache[0], tri_cache[1], out, batch.block_table, batch.seq_lens,
                            batch.query_start_loc, num_tokens=3, num_seqs=3, scale=spec.scale, sliding_window=window,
                            decode=True, num_splits=splits, config=config, new_kv=(k, v, batch.slot_mapping))
            assert torch.equal(tri_cache, ref_cache)
            torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])


def test_new_kv_is_refused_for_prefill_launches():
    from dovetail.triton.paged_attention import paged_attention

    q, k, v, cache, batch = make_case([3], [3], seed=16)
    with pytest.raises(ValueError, match="new_kv is for decode launches only"):
        paged_attention(q, cache[0], cache[1], torch.empty_like(q), batch.block_table, batch.seq_lens,
                        batch.query_start_loc, num_tokens=3, num_seqs=1, scale=1.0, new_kv=(k, v, batch.slot_mapping))


def test_decodes_taken_longest_first_give_the_same_output():
    """The builder orders the decodes by context, longest first; every order and both program numberings
    give the same output, bit for bit, as taking them as they come."""
    from dovetail.attention.triton_backend import TritonMetadataBuilder
    from dovetail.triton.paged_attention import LaunchConfig, default_config, paged_attention

    case = make_case([1, 1, 1, 1, 2], [9, 40, 17, 40, 6], num_heads=4, num_kv_heads=2, seed=13)
    q, k, v, cache, batch = case
    spec = spec_for(case)
    builder = TritonMetadataBuilder(TritonBackend, [spec], 4, torch.device(DEVICE), torch.float32)
    metadata = builder.build(batch)
    assert metadata.decode_order.tolist() == [1, 3, 2, 0]  # ties (the two 40s) keep their order
    check((q, k, v, cache, metadata), spec)
    plain = default_config(32, 2, True, torch.float32)
    for heads_fastest in (False, True):
        config = LaunchConfig(plain.block_m, plain.tile_n, plain.num_warps, plain.num_stages, heads_fastest)
        outs = []
        for order in (None, metadata.decode_order, torch.tensor([2, 0, 3, 1], dtype=torch.int32, device=DEVICE)):
            out = torch.full_like(q, float("nan"))
            paged_attention(q, cache[0], cache[1], out, batch.block_table, batch.seq_lens, batch.query_start_loc,
                            num_tokens=4, num_seqs=4, scale=spec.scale, decode=True, config=config,
                            decode_order=order)
            outs.append(out[:4])
        assert not outs[0].isnan().any()
        assert all(torch.equal(out, outs[0]) for out in outs[1:])


def test_graph_order_buffer_keeps_its_address_and_takes_each_steps_lengths():
    from dovetail.attention.triton_backend import TritonMetadataBuilder

    q, k, v, cache, batch = make_case([1, 1, 1], [5, 12, 8], seed=14)
    builder = TritonMetadataBuilder(TritonBackend, [spec_for((q, k))], 4, torch.device(DEVICE), torch.float32)
    first = builder.build_for_graph(batch, 3).decode_order
    assert first.tolist() == [1, 2, 0]
    batch.seq_lens_cpu.copy_(torch.tensor([12, 5, 8], dtype=torch.int32))
    second = builder.build_for_graph(batch, 3).decode_order
    assert second.data_ptr() == first.data_ptr() and second.tolist() == [0, 2, 1]
    assert builder.build_for_graph(batch, 2).decode_order.data_ptr() != first.data_ptr()


def test_prefill_only_batches_have_no_decode_order():
    from dovetail.attention.triton_backend import TritonMetadataBuilder

    q, k, v, cache, batch = make_case([3, 6], [10, 7], seed=15)
    builder = TritonMetadataBuilder(TritonBackend, [spec_for((q, k))], 4, torch.device(DEVICE), torch.float32)
    metadata = builder.build(batch)
    assert metadata.decode_order is None
    check((q, k, v, cache, metadata), spec_for((q, k)))


def requirements(**overrides):
    base = dict(platform="cuda", device_type="cuda", dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16,
                head_size=128, num_heads=32, num_kv_heads=8, uses_sliding_window=True, uses_logit_softcap=True)
    base.update(overrides)
    return AttentionRequirements(**base)


def test_backend_declares_and_validates():
    assert TritonBackend.available() is None
    assert TritonBackend.validate(requirements()) == []
    caps = TritonBackend.capabilities()
    assert {64, 80, 96, 128, 256} <= set(caps["head_sizes"])
    assert set(caps["dtypes"]) == {"float16", "bfloat16", "float32"}
    reasons = TritonBackend.validate(requirements(head_size=48, kv_cache_dtype="fp8_e5m2", device_type="cpu",
                                                  num_heads=12, num_kv_heads=5))
    text = "\n".join(reasons)
    assert "head size 48" in text and "kv_cache_dtype 'fp8_e5m2'" in text and "device type 'cpu'" in text
    assert "multiple of num_kv_heads" in text


def test_registered_path_resolves_to_the_backend():
    from dovetail.lazy_import import resolve

    assert resolve("dovetail.attention.triton_backend:TritonBackend") is TritonBackend


def test_import_is_lazy_and_absence_of_triton_is_explained():
    code = (
        "import sys\n"
        "import dovetail.attention.triton_backend as m\n"
        "assert 'triton' not in sys.modules, 'triton imported at module import'\n"
        "sys.modules['triton'] = None\n"
        "print(m.TritonBackend.available())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "triton cannot be imported" in result.stdout and "pip install" in result.stdout


class _TritonHere(TritonBackend):
    """TRITON, also allowed on the CPU device, where the kernels run in the interpreter."""

    supported_device_types = ("cuda", "xpu", "cpu")


@pytest.mark.parametrize("case", testing.attention_cases(head_sizes=(64,)), ids=str)
def test_conformance_kit_cases(case):
    testing.check_attention_case(_TritonHere, case, device=DEVICE, platform="cuda")


def test_kernel_modules_import_without_touching_a_device():
    testing.check_import_is_cheap("dovetail.attention.triton_backend", "dovetail.triton.paged_attention",
                                  "dovetail.triton.kv_cache_write", "dovetail.triton.fused_ops")


def _rotary_inputs(case, rotary_dim, norm_dtype, seed):
    """Positions of every row, a cos/sin table, and (with ``norm_dtype``) random per-head norm weights;
    ``apply`` is the rotary kernel, whose arithmetic the decode launch repeats."""
    from dovetail.attention.backend import RotaryInputs
    from dovetail.layers.rotary import compute_cos_sin_cache
    from dovetail.triton.rotary import rotary_embedding

    q, k, v, cache, batch = case
    head_size = q.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    positions = testing.row_positions(batch, DEVICE)
    table = compute_cos_sin_cache(rotary_dim, 64, {"rope_theta": 100.0, "rope_type": "default"}, 64).to(DEVICE)
    weights = {}
    if norm_dtype is not None:
        weights = {name: (1 + 0.5 * torch.randn(head_size, generator=gen)).to(DEVICE, norm_dtype)
                   for name in ("q_norm_weight", "k_norm_weight")}

    def apply(pos, q2, k2):
        return rotary_embedding(pos, q2, k2, table, head_size, rotary_dim, weights.get("q_norm_weight"),
                                weights.get("k_norm_weight"), 1e-5)

    return RotaryInputs(positions, table, rotary_dim, apply, eps=1e-5, **weights)


@pytest.mark.parametrize("split_launch", [True, False], ids=["split-decode-launch", "unsplit"])
@pytest.mark.parametrize("dtype,rotary_dim,norm_dtype", [
    (torch.float32, 32, None), (torch.bfloat16, 32, None), (torch.float32, 16, None),
    (torch.bfloat16, 32, torch.float32), (torch.bfloat16, 32, torch.bfloat16), (torch.float16, 32, torch.float16)])
def test_decode_launch_rotates_its_rows(dtype, rotary_dim, norm_dtype, split_launch, monkeypatch):
    """``forward_rotary``: TRITON rotates the decodes' q and k in a split decode launch (four splits; partial
    rotary, q/k norms with float32 or model-dtype weights); the other rows (all of them, unsplit) go through
    the rotary kernel that also writes the cache (whole-head rotary) or through ``apply`` (partial). The base
    class applies the rotary to every row first. Same output and cache, on a mixed batch with random
    (unrotated) q and k."""
    from dovetail.triton import paged_attention

    monkeypatch.setattr(TritonAttentionImpl, "_fuses_into_decode_launch", lambda self, n, q: split_launch and n > 0)
    if split_launch:  # split as on a GPU (a machine of few cores would not split three decodes)
        monkeypatch.setattr(paged_attention, "default_num_splits", lambda num_seqs, num_kv_heads, device: 4)
    case = make_case([1, 1, 1, 4, 3], [1, 23, 9, 7, 12], num_heads=4, num_kv_heads=2, dtype=dtype, seed=17)
    q, k, v, cache, batch = case
    spec = spec_for(case)
    rotary = _rotary_inputs(case, rotary_dim, norm_dtype, seed=18)
    ref_cache, tri_cache = cache.clone(), cache.clone()
    expected = ReferenceAttentionImpl(spec).forward_rotary(q, k, v, ref_cache, batch, rotary)
    actual = TritonAttentionImpl(spec).forward_rotary(q, k, v, tri_cache, batch, rotary)
    torch.testing.assert_close(tri_cache.float(), ref_cache.float(), **TOLERANCE[dtype])
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])
    unrotated = ReferenceAttentionImpl(spec).forward(q, k, v, cache.clone(), batch)
    assert not torch.allclose(unrotated[:3].float(), expected[:3].float(), atol=0.1)


def test_rotary_the_launch_cannot_apply_falls_back_to_the_platform_rotation():
    """A cos/sin table in float16 is not one the decode launch reads: ``apply`` rotates every row."""
    import dataclasses

    from dovetail.triton.paged_attention import rotary_fits

    case = make_case([1, 1, 2], [5, 9, 6], seed=19)
    q, k, v, cache, batch = case
    rotary = _rotary_inputs(case, 32, None, seed=20)
    calls = []

    def counting_apply(pos, q2, k2):
        calls.append(q2.shape[0])
        return rotary.apply(pos, q2, k2)

    half_table = dataclasses.replace(rotary, cos_sin_cache=rotary.cos_sin_cache.half().float().half(),
                                     apply=counting_apply)
    assert rotary_fits(rotary, q, k) and not rotary_fits(half_table, q, k)
    spec = spec_for(case)
    ref_cache, tri_cache = cache.clone(), cache.clone()
    expected = ReferenceAttentionImpl(spec).forward_rotary(q, k, v, ref_cache, batch, rotary)
    actual = TritonAttentionImpl(spec).forward_rotary(q, k, v, tri_cache, batch, half_table)
    assert calls == [4]
    torch.testing.assert_close(actual, expected, atol=2e-3, rtol=2e-3)


def test_only_split_decode_launches_take_over_the_cache_write_and_rotation():
    """Small decode batches (split launches) write and rotate in the decode launch; batches that fill the
    device have the cache write and the rotary kernel first, so that no program's first key read waits."""
    from dovetail.triton.paged_attention import default_num_splits

    impl = TritonAttentionImpl(AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_size=32, scale=1.0))
    q = torch.empty(1, 4, 32, device=DEVICE)
    assert default_num_splits(1, 2, q.device) > 1 and impl._fuses_into_decode_launch(1, q)
    assert default_num_splits(4096, 2, q.device) == 1 and not impl._fuses_into_decode_launch(4096, q)
    assert not impl._fuses_into_decode_launch(0, q)
