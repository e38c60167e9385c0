"""The fused Triton MoE (routing, alignment, grouped GEMMs, sum) against the plain-torch definition, on random inputs.

Without a GPU the kernels run in triton's CPU interpreter (``TRITON_INTERPRET=1`` is
set when this module is collected, before triton is first imported) at tiny
shapes; with a GPU the same tests run the compiled kernels. The interpreter rounds
float32 to bfloat16 by truncation and the GPU to nearest: bfloat16 tolerances
cover both, and the tight comparisons use float32 and float16.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from dovetail import testing  # noqa: E402
from dovetail.moe_ops import Fp8ExpertScales, fused_experts, moe_reference, select_experts  # noqa: E402
from dovetail.ops import FusedOps  # noqa: E402
from dovetail.quantization import quant_ops  # noqa: E402
from dovetail.triton import fused_moe as fused_moe_module  # noqa: E402
from dovetail.triton.fused_moe import fused_moe, routed_moe  # noqa: E402
from dovetail.triton.fused_ops import TritonFusedOps  # noqa: E402
from dovetail.triton.moe_align import align_pairs, max_padded, route_and_align  # noqa: E402
from dovetail.triton.moe_configs import MoeConfig  # noqa: E402
from dovetail.triton.moe_gemm import GemmConfig  # noqa: E402
from dovetail.triton.moe_routing import topk_softmax  # noqa: E402

TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=5e-3, rtol=5e-3),
             torch.bfloat16: dict(atol=4e-2, rtol=4e-2)}


@pytest.fixture(scope="module", autouse=True)
def kernels_can_run_here():
    from dovetail.triton import interpreter_active

    if DEVICE == "cpu" and not interpreter_active():
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run on "
                    "the CPU in this process; something collected earlier imports triton at import time")


def moe_inputs(tokens, experts, top_k, hidden=32, inter=16, dtype=torch.float32, seed=0, router_experts=None):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)

    x = rand(tokens, hidden)
    w13 = rand(experts, 2 * inter, hidden, scale=hidden ** -0.5)
    w2 = rand(experts, hidden, inter, scale=inter ** -0.5)
    logits = torch.randn(tokens, router_experts or experts, generator=gen).to(DEVICE)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


def assert_moe_close(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert expected.float().abs().max() > 0.1, "the inputs must not be degenerate"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[expected.dtype])


# -- routing -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (37, 60, 4), (5, 128, 8), (300, 16, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_matches_the_softmax_top_k(tokens, experts, top_k, renormalize):
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(experts)).to(DEVICE)
    weights, ids = topk_softmax(logits, top_k, renormalize)  # float32: no ties, which torch.topk orders its own way
    want_weights, want_ids = select_experts(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-5)


def test_routing_of_16_bit_logits_breaks_ties_towards_the_lower_expert():
    logits = torch.zeros(2, 6, device=DEVICE, dtype=torch.bfloat16)
    logits[:, [1, 4]] = 3.0
    weights, ids = topk_softmax(logits, 3, renormalize=True)
    assert ids.tolist() == [[1, 4, 0], [1, 4, 0]]
    big, small = 1 / (2 + torch.exp(torch.tensor(-3.0))), torch.exp(torch.tensor(-3.0)) / (2 + torch.exp(torch.tensor(-3.0)))
    torch.testing.assert_close(weights.cpu(), torch.tensor([[big, big, small]] * 2))


# -- alignment -----------------------------------------------------------------------------------------------


def in_pair_order(aligned) -> list[int]:
    """The entries in use with each expert's run of blocks sorted (the kernels place an expert's pairs in no set
    order): its pairs ascending, then its padding, the largest value."""
    entries = aligned.sorted_pairs[:int(aligned.num_padded)].tolist()
    experts = aligned.block_expert.tolist()[:len(entries) // aligned.block_m]
    out, start = [], 0
    for block in range(1, len(experts) + 1):
        if block == len(experts) or experts[block] != experts[start]:
            out += sorted(entries[start * aligned.block_m:block * aligned.block_m])
            start = block
    return out


def expected_layout(ids: torch.Tensor, experts: int, block_m: int, expert_map=None):
    flat = ids.reshape(-1).long().cpu()
    if expert_map is not None:
        flat = expert_map.cpu().long()[flat]
    pairs, blocks = [], []
    for e in range(experts):
        mine = (flat == e).nonzero().flatten().tolist()
        if mine:
            pad = -len(mine) % block_m
            pairs += mine + [flat.numel()] * pad
            blocks += [e] * ((len(mine) + pad) // block_m)
    return pairs, blocks


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (9, 4, 4), (70, 128, 8), (600, 8, 2), (512, 60, 3)])
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("path", ["one program", "counted by chunk"])
def test_alignment_sorts_by_expert_and_pads_to_blocks(tokens, experts, top_k, block_m, path):
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices.to(DEVICE, torch.int32)
    aligned = align_pairs(ids, experts, block_m, small_pairs=10**9 if path == "one program" else 0)
    pairs, blocks = expected_layout(ids, experts, block_m)
    used = int(aligned.num_padded)
    assert used == len(pairs) and used <= aligned.sorted_pairs.numel() == max_padded(ids.numel(), experts, block_m)
    assert in_pair_order(aligned) == pairs
    got_blocks = aligned.block_expert.tolist()
    assert got_blocks[:len(blocks)] == blocks and set(got_blocks[len(blocks):]) <= {-1}


@pytest.mark.parametrize("path", ["one program", "counted by chunk"])
def test_alignment_through_an_expert_map_leaves_out_experts_held_elsewhere(path):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 8, (40, 3), generator=gen).to(DEVICE)
    expert_map = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32, device=DEVICE)
    aligned = align_pairs(ids, 4, 16, expert_map, small_pairs=10**9 if path == "one program" else 0)
    pairs, blocks = expected_layout(ids, 4, 16, expert_map)
    assert in_pair_order(aligned) == pairs
    assert aligned.block_expert.tolist()[:len(blocks)] == blocks


@pytest.mark.parametrize("tokens,experts,top_k,renormalize", [(9, 4, 4, True), (70, 128, 8, True), (600, 8, 2, False),
                                                              (130, 60, 3, True)])
@pytest.mark.parametrize("path", ["one program", "counted by chunk"])
def test_routing_in_the_alignment_equals_routing_then_aligning(tokens, experts, top_k, renormalize, path):
    """The routed alignment stores the router's ids and weights (to float32's rounding: a GPU sums the
    softmax in another order in another tiling) and lays their pairs out as :func:`align_pairs` does (16-bit
    logits, which tie often, break ties alike)."""
    gen = torch.Generator().manual_seed(tokens + experts)
    logits = (torch.randn(tokens, experts, generator=gen) * 2).to(DEVICE, torch.bfloat16)
    small = 10**9 if path == "one program" else 0
    weights, ids, aligned = route_and_align(logits, top_k, renormalize, experts, 16, small_pairs=small)
    want_weights, want_ids = topk_softmax(logits, top_k, renormalize)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=0)
    want_aligned = align_pairs(want_ids, experts, 16, small_pairs=small)
    assert in_pair_order(aligned) == in_pair_order(want_aligned) == expected_layout(ids, experts, 16)[0]
    assert aligned.block_expert.tolist() == want_aligned.block_expert.tolist()


@pytest.mark.parametrize("path", ["one program", "counted by chunk"])
def test_routing_in_the_alignment_through_an_expert_map(path):
    logits = torch.randn(40, 8, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    expert_map = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32, device=DEVICE)
    weights, ids, aligned = route_and_align(logits, 3, True, 4, 16, expert_map,
                                            small_pairs=10**9 if path == "one program" else 0)
    want_weights, want_ids = select_experts(logits, 3, True)
    assert torch.equal(ids.long(), want_ids.long())
    torch.testing.assert_close(weights, want_weights)
    pairs, blocks = expected_layout(ids, 4, 16, expert_map)
    assert in_pair_order(aligned) == pairs
    assert aligned.block_expert.tolist()[:len(blocks)] == blocks


# -- the fused experts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (3, 4, 1), (17, 16, 4), (64, 8, 2), (512, 8, 2)])
def test_fused_moe_matches_the_reference(tokens, experts, top_k):
    x, w13, w2, weights, ids = moe_inputs(tokens, experts, top_k, seed=tokens)
    assert_moe_close(fused_moe(x, w13, w2, weights, ids), moe_reference(x, w13, w2, weights, ids))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_fused_moe_in_16_bits(dtype, activation):
    x, w13, w2, weights, ids = moe_inputs(24, 8, 2, hidden=64, inter=32, dtype=dtype, seed=5)
    assert_moe_close(fused_moe(x, w13, w2, weights, ids, activation),
                     moe_reference(x, w13, w2, weights, ids, activation))


@pytest.mark.parametrize("config", [
    MoeConfig(16, GemmConfig(16, 16), GemmConfig(16, 32)),  # several tiles over N and K, K a multiple of BLOCK_K
    MoeConfig(32, GemmConfig(32, 64, group_m=4), GemmConfig(64, 16, group_m=2)),  # grouped order of the programs
], ids=["many-tiles", "grouped"])
def test_fused_moe_tiles_over_n_and_k(config):
    x, w13, w2, weights, ids = moe_inputs(40, 4, 2, hidden=48, inter=40, seed=7)
    assert_moe_close(fused_moe(x, w13, w2, weights, ids, config=config), moe_reference(x, w13, w2, weights, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,block_n,block_k", [(1, 16, 32), (40, 16, 32), (40, 32, 16), (300, 64, 64)],
                         ids=["one token", "N and K uneven", "K tiles", "counted by chunk"])
def test_weight_tiles_through_a_tensor_descriptor(dtype, tokens, block_n, block_k):
    """The gate/up and down GEMMs with the weight tiles read through a tensor descriptor: the same products as
    read by address, where the tiles pass the expert's last output (N=40 at 16, 32 and 64 a tile) and its
    last key (K=48 at 32 and 64)."""
    x, w13, w2, weights, ids = moe_inputs(tokens, 8, 2, hidden=48, inter=40, dtype=dtype, seed=tokens + block_n)
    block_m = 16 if tokens < 100 else 64
    by_address = MoeConfig(block_m, GemmConfig(block_n, block_k), GemmConfig(block_n, block_k))
    by_descriptor = MoeConfig(block_m, GemmConfig(block_n, block_k, tma=True), GemmConfig(block_n, block_k, tma=True))
    expected = fused_moe(x, w13, w2, weights, ids, config=by_address)
    assert_moe_close(expected, moe_reference(x, w13, w2, weights, ids))
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, config=by_descriptor), expected, atol=0, rtol=0)


def test_descriptor_tiles_read_by_address_the_weights_a_descriptor_cannot_take():
    """A tuned table's descriptor tiles meet weights of the layer's shape that are not contiguous (a view into a
    wider tensor): the layer reads those by address and computes the same products."""
    x, w13, w2, weights, ids = moe_inputs(40, 8, 2, hidden=48, inter=40, dtype=torch.bfloat16, seed=17)
    wide = torch.zeros(*w13.shape[:2], 64, dtype=w13.dtype, device=DEVICE)
    wide[..., :48] = w13
    strided = wide[..., :48]
    assert not strided.is_contiguous()
    by_address = MoeConfig(16, GemmConfig(16, 32), GemmConfig(16, 32))
    by_descriptor = MoeConfig(16, GemmConfig(16, 32, tma=True), GemmConfig(16, 32, tma=True))
    expected = fused_moe(x, w13, w2, weights, ids, config=by_address)
    torch.testing.assert_close(fused_moe(x, strided, w2, weights, ids, config=by_descriptor), expected, atol=0, rtol=0)


def test_tensor_descriptor_tiles_refuse_rows_of_partial_16_byte_units():
    from dovetail.triton.moe_gemm import grouped_gemm

    x, w13, w2, weights, ids = moe_inputs(5, 4, 2, hidden=50, dtype=torch.bfloat16, seed=3)
    aligned = align_pairs(ids.to(torch.int32), 4, 16)
    out = torch.empty(10, 16, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="whole 16-byte units"):
        grouped_gemm(x, w13, out, aligned, GemmConfig(16, 16, tma=True), 2, gated=True)


def test_every_token_on_one_expert_and_experts_without_tokens():
    x, w13, w2, weights, _ = moe_inputs(33, 8, 2, seed=11)
    ids = torch.tensor([[5, 2]] * 33, device=DEVICE)  # experts 5 and 2 take every token; six take none
    weights = torch.rand(33, 2, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert_moe_close(fused_moe(x, w13, w2, weights, ids), moe_reference(x, w13, w2, weights, ids))


def test_long_batches_run_in_passes(monkeypatch):
    monkeypatch.setattr(fused_moe_module, "MAX_CHUNK_TOKENS", 16)
    x, w13, w2, weights, ids = moe_inputs(40, 4, 2, seed=13)
    assert_moe_close(fused_moe(x, w13, w2, weights, ids), moe_reference(x, w13, w2, weights, ids))


@pytest.mark.parametrize("tokens,experts,top_k,chunk", [(1, 8, 2, 8192), (17, 16, 4, 8192), (300, 8, 2, 8192),
                                                        (41, 4, 2, 16)])
def test_routed_moe_routes_from_the_logits(tokens, experts, top_k, chunk, monkeypatch):
    """From the router's logits (one token, one program, counted by chunk, several passes): the reference of the
    softmax top-k's experts."""
    monkeypatch.setattr(fused_moe_module, "MAX_CHUNK_TOKENS", chunk)
    x, w13, w2, _, _ = moe_inputs(tokens, experts, top_k, seed=tokens + 1)
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    weights, ids = select_experts(logits, top_k, renormalize=False)
    assert_moe_close(routed_moe(x, logits, w13, w2, top_k, False), moe_reference(x, w13, w2, weights, ids))


@pytest.mark.parametrize("tokens", [1, 21])
def test_expert_map_adds_nothing_for_experts_held_elsewhere(tokens):
    """Expert parallelism: this rank holds global experts 1, 3, 4 and 6 as rows 0-3."""
    expert_map = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32, device=DEVICE)
    x, w13, w2, weights, ids = moe_inputs(tokens, 4, 3, seed=17, router_experts=8)
    if tokens == 1:
        ids = torch.tensor([[2, 4, 6]], device=DEVICE)  # one expert held elsewhere
    expected = moe_reference(x, w13, w2, weights, ids, expert_map=expert_map)
    assert_moe_close(fused_moe(x, w13, w2, weights, ids, expert_map=expert_map), expected)
    assert_moe_close(fused_experts(x, w13, w2, weights, ids, expert_map=expert_map), expected)
    # the definition: a sum over the held experts only
    held = expert_map.long()[ids.long()]
    manual = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(held[t, j])
            if e >= 0:
                gate, up = (w13[e] @ x[t]).chunk(2)
                manual[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(expected, manual, atol=1e-4, rtol=1e-4)
    # two ranks holding complementary experts add up to the whole layer
    other_map = torch.tensor([0, -1, 1, -1, -1, 2, -1, 3], dtype=torch.int32, device=DEVICE)
    _, w13b, w2b, _, _ = moe_inputs(tokens, 4, 3, seed=19)
    full_w13 = torch.stack([w13b[0], w13[0], w13b[1], w13[1], w13[2], w13b[2], w13[3], w13b[3]])
    full_w2 = torch.stack([w2b[0], w2[0], w2b[1], w2[1], w2[2], w2b[2], w2[3], w2b[3]])
    both = expected + fused_moe(x, w13b, w2b, weights, ids, expert_map=other_map)
    assert_moe_close(both, moe_reference(x, full_w13, full_w2, weights, ids))


@pytest.mark.parametrize("tokens", [21, 700], ids=["one program", "counted by chunk"])
def test_routed_moe_through_an_expert_map(tokens):
    """Routing inside the alignment on a rank that holds global experts 1, 3, 4 and 6: the reference's sum over
    the held experts of the softmax top-k."""
    expert_map = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32, device=DEVICE)
    x, w13, w2, _, _ = moe_inputs(tokens, 4, 3, seed=tokens)
    logits = torch.randn(tokens, 8, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    weights, ids = select_experts(logits, 3, renormalize=True)
    assert_moe_close(routed_moe(x, logits, w13, w2, 3, True, expert_map=expert_map),
                     moe_reference(x, w13, w2, weights, ids, expert_map=expert_map))


# -- FP8 experts ---------------------------------------------------------------------------------------------


def quantize_experts(w: torch.Tensor, block: tuple[int, int] | None):
    """FP8 experts with per-channel or block scales, as an FP8 checkpoint stores them."""
    qs, scales = [], []
    for expert in w.float().cpu():
        if block is None:
            q, s = quant_ops.quantize_fp8_per_channel(expert)
        else:
            (bn, bk), (n, k) = block, expert.shape
            blocks = expert.reshape(n // bn, bn, k // bk, bk)
            s = (blocks.abs().amax(dim=(1, 3)) / quant_ops.FP8_MAX).clamp(min=1e-12)
            q = (blocks / s[:, None, :, None]).reshape(n, k).to(quant_ops.fp8_dtype())
        qs.append(q)
        scales.append(s)
    return torch.stack(qs).to(DEVICE), torch.stack(scales).to(DEVICE)


@pytest.mark.parametrize("block", [None, (16, 32), (32, 32)], ids=["per-channel", "block16x32", "block32x32"])
@pytest.mark.parametrize("dtype,tokens", [(torch.float16, 19), (torch.bfloat16, 19), (torch.float16, 1)])
def test_fp8_experts_match_the_dequantized_reference(block, dtype, tokens):
    x, w13, w2, weights, ids = moe_inputs(tokens, 4, 2, hidden=64, inter=32, dtype=dtype, seed=23)
    q13, s13 = quantize_experts(w13, block)
    q2, s2 = quantize_experts(w2, block)
    fp8 = Fp8ExpertScales(s13, s2, block)
    expected = moe_reference(x, q13, q2, weights, ids, fp8=fp8)
    # the reference is the float layer up to FP8's rounding
    torch.testing.assert_close(expected.float(), moe_reference(x, w13, w2, weights, ids).float(), atol=0.3, rtol=0.1)
    assert_moe_close(fused_experts(x, q13, q2, weights, ids, fp8=fp8), expected)
    got = fused_moe(x, q13, q2, weights, ids, fp8=fp8)
    if DEVICE == "cpu":  # the interpreter's arithmetic is the reference's
        assert_moe_close(got, expected)
    else:  # a GPU's accumulation order may move an intermediate value across an FP8 rounding boundary
        err = (got.float() - expected.float()).abs()
        scale = expected.float().abs().max()
        assert err.max() <= 0.03 * scale and err.mean() <= 0.003 * scale, (err.max(), err.mean(), scale)


# -- the platform seam, and no host synchronisation ----------------------------------------------------------


def test_triton_fused_ops_route_and_run_the_experts():
    ops = TritonFusedOps()
    x, w13, w2, _, _ = moe_inputs(10, 8, 2, seed=29)
    logits = torch.randn(10, 8, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    weights, ids = ops.select_experts(logits, 2, True)
    assert ids.dtype == torch.int32  # the Triton router, not torch's top-k
    expected = FusedOps().fused_moe(x, w13, w2, *FusedOps().select_experts(logits, 2, True))
    assert_moe_close(ops.fused_moe(x, w13, w2, weights, ids), expected)
    assert_moe_close(ops.routed_moe(x, logits, w13, w2, 2, True), expected)
    # operands the kernel does not take (no tokens) go to the torch definition
    assert ops.fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)
    assert ops.routed_moe(x[:0], logits[:0], w13, w2, 2, True).shape == (0, 32)


@pytest.mark.parametrize("tokens,top_k", [(1, 2), (13, 4), (150, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_after_the_experts_sums_their_outputs(tokens, top_k, dtype):
    """The experts' outputs left unsummed, then summed in the norm's kernel with the residual add: as the sum's
    own kernel followed by the add and norm (one token, one program, counted by chunk; hidden not a power of 2)."""
    from dovetail.moe_ops import ExpertOutputs

    ops = TritonFusedOps()
    x, w13, w2, _, _ = moe_inputs(tokens, 16, top_k, hidden=48, dtype=dtype, seed=tokens + top_k)
    gen = torch.Generator().manual_seed(tokens)
    logits = torch.randn(tokens, 16, generator=gen).to(DEVICE)
    residual = torch.randn(tokens, 48, generator=gen).to(device=DEVICE, dtype=dtype)
    weight = (torch.rand(48, generator=gen) + 0.5).to(device=DEVICE, dtype=dtype)
    experts = ops.routed_moe_unsummed(x, logits, w13, w2, top_k, True)
    assert isinstance(experts, ExpertOutputs) and experts.pairs.shape == (tokens * top_k, 48)
    normed, summed = ops.add_rms_norm_experts(experts, residual, weight, 1e-6)
    want_normed, want_summed = ops.add_rms_norm(ops.routed_moe(x, logits, w13, w2, top_k, True), residual, weight,
                                                1e-6)
    assert_moe_close(summed, want_summed)
    assert_moe_close(normed, want_normed)
    torch.testing.assert_close(summed, want_summed, atol=0, rtol=0)  # the sum rounded as the sum kernel rounds it
    by_definition = FusedOps().add_rms_norm_experts(experts, residual, weight, 1e-6)
    for actual, expected in zip((normed, summed), by_definition):
        assert_moe_close(actual, expected)


def test_the_gpu_path_reads_no_device_value_on_the_host():
    """What a CUDA graph captures: routing and experts with no ``.item()``/``.tolist()``/mask-sized op in
    Dovetail's code. The plain-torch path (which reads per-expert counts on the host) trips the same guard."""
    from dovetail.layers.moe import FusedMoE
    from dovetail.model_interface import ModelContext
    from dovetail.quantization.unquantized import UnquantizedMethod

    ctx = ModelContext(dtype=torch.float32, device=torch.device(DEVICE), quant=UnquantizedMethod(),
                       attention_backend=None, ops=TritonFusedOps())
    layer = FusedMoE(8, 2, 32, 16, ctx, "mlp.experts", expert_map=[0, 1, 2, 3, -1, -1, 4, 5]).to(DEVICE)
    x, w13, w2, _, _ = moe_inputs(12, 6, 2, seed=31)
    layer.w13_weight.data.copy_(w13)
    layer.w2_weight.data.copy_(w2)
    logits = torch.randn(12, 8, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with testing.forbid_host_sync():
        out = layer(x, logits)
    weights, ids = select_experts(logits, 2, True)
    assert_moe_close(out, moe_reference(x, w13, w2, weights, ids, expert_map=layer.expert_map_device))
    with pytest.raises(testing.HostSyncError), testing.forbid_host_sync():
        FusedOps().fused_moe(x, w13, w2, weights, ids)


@pytest.mark.skipif(DEVICE != "cpu", reason="the engine's CPU platform with a stand-in graph capture")
def test_moe_decode_steps_run_in_a_stand_in_capture_without_host_synchronisation(tmp_path):
    """A tiny Qwen3-MoE on the engine, its MoE layers on the Triton path, decode steps "captured" by a platform
    whose capture and replays run under :func:`dovetail.testing.forbid_host_sync`; tokens as HF's."""
    from transformers import Qwen3MoeConfig

    from dovetail import LLM, SamplingParams
    from dovetail.layers.moe import FusedMoE
    from test_cuda_graph_runner import DeviceOnlyImpl, ReplayGraph, ReplayPlatform
    from tiny_models import assert_greedy_matches, hf_greedy, load_hf, save_model

    class GuardedReplayPlatform(ReplayPlatform):
        """Captures and replays raise where Dovetail's code reads a device value on the host."""

        def capture_graph(self, fn, pool=None):
            def guarded():
                with testing.forbid_host_sync():
                    return fn()

            return ReplayGraph(guarded), guarded()

    config = Qwen3MoeConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                            max_position_embeddings=256, initializer_range=0.1, bos_token_id=0, eos_token_id=1)
    path = save_model(tmp_path / "qwen3moe", config)
    prompts, max_tokens = [[5, 6, 7, 8], list(range(20, 41)), [3]], [6, 5, 4]
    hf = load_hf(path)
    reference = [hf_greedy(hf, p, n) for p, n in zip(prompts, max_tokens)]
    llm = LLM(str(path), device="cpu", attention_backend="REFERENCE", max_num_seqs=4)
    runner = llm.llm_engine.runner
    layers = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(layers) == 2
    for layer in layers:
        layer.ops = TritonFusedOps()
    for layer in runner.attention_layers:
        layer.impl = DeviceOnlyImpl(layer.spec)
    runner.platform, runner.use_graphs = GuardedReplayPlatform(), True
    runner.capture_graphs()
    assert runner.graphs.sizes == [1, 2, 4]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, (tokens, logprobs) in zip(outputs, reference):
        assert_greedy_matches(out.outputs[0].token_ids, tokens, logprobs)
    assert sum(graph.replays for graph in runner.graphs.graphs.values()) >= 4


# -- tile configurations -------------------------------------------------------------------------------------

def _shape():
    from dovetail.triton.moe_configs import LayerShape

    return LayerShape(experts=128, inter=768, hidden=2048, top_k=8, dtype="bfloat16", quant="none")


def test_tile_tables_persist_tuned_configurations_only(tmp_path, caplog):
    from dovetail.triton.moe_configs import ConfigTable, default_config

    shape = _shape()
    tuned, fallback = {1: MoeConfig(16, GemmConfig(32, 256), GemmConfig(64, 128))}, {2: default_config(2, shape)}
    table = ConfigTable("gpu-kind", tmp_path)
    table.store(shape, tuned, fallback)
    assert table.get(shape) == {**tuned, **fallback}
    assert ConfigTable("gpu-kind", tmp_path).get(shape) == tuned, "a fallback is not saved: the next start tunes it"
    (tmp_path / "gpu-kind" / shape.file_name()).write_text("{not json")
    assert ConfigTable("gpu-kind", tmp_path).get(shape) == {}
    assert "ignoring unreadable tile table" in caplog.text


def test_defaults_follow_the_rows_each_expert_gets():
    from dovetail.triton.moe_configs import bucket, default_config

    shape = _shape()
    assert [bucket(t) for t in (1, 3, 200, 8192, 100000)] == [1, 4, 256, 8192, 8192]
    assert default_config(1, shape).block_m == 16  # a decode step: 8 rows over 128 experts
    assert default_config(4096, shape).block_m == 128  # a prefill: 256 rows per expert


def test_tuning_runs_once_per_missing_bucket_and_failures_fall_back(tmp_path, monkeypatch):
    from dovetail.triton import moe_tuner
    from dovetail.triton.moe_configs import default_config

    shape, calls = _shape(), []
    picked = MoeConfig(16, GemmConfig(16, 256), GemmConfig(32, 128))

    def fake_tune(buckets, *args):
        calls.append(list(buckets))
        return {b: picked for b in buckets if b != 4}  # the bucket of 4 tokens fails to tune

    monkeypatch.setenv("DOVETAIL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fused_moe_module, "tuning_enabled", lambda device: True)
    monkeypatch.setattr(fused_moe_module, "_device_key", lambda device: "gpu-kind")
    monkeypatch.setattr(moe_tuner, "tune", fake_tune)
    fused_moe_module._table.cache_clear()
    try:
        assert fused_moe_module.select_config(3, shape, torch.empty(0), None, None) == default_config(3, shape)
        assert fused_moe_module.select_config(2, shape, torch.empty(0), None, None) == picked
        assert fused_moe_module.select_config(10, shape, torch.empty(0), None, None) == picked
        assert calls == [[1, 2, 4], [8, 16]]
        saved = fused_moe_module.ConfigTable("gpu-kind", tmp_path / "moe").get(shape)
        assert sorted(saved) == [1, 2, 8, 16]
    finally:
        fused_moe_module._table.cache_clear()


def test_tuning_leaves_out_a_failed_bucket_and_tunes_a_rank_with_fewer_experts_than_top_k(monkeypatch):
    from dovetail.triton import moe_tuner
    from dovetail.triton.moe_configs import LayerShape

    # Expert parallelism can leave a rank one expert while each token picks two; every candidate then "runs"
    # in no time, so the first one wins.
    shape = LayerShape(experts=1, inter=32, hidden=32, top_k=2, dtype="float32", quant="none")
    w13 = torch.randn(1, 64, 32, device=DEVICE)
    w2 = torch.randn(1, 32, 32, device=DEVICE)
    timed = []
    monkeypatch.setattr(moe_tuner, "_time", lambda fn: timed.append(fn) or 1.0)
    real_bucket = moe_tuner.tune_bucket

    def bucket_failing_at_two(tokens, *args):
        if tokens == 2:
            raise RuntimeError("out of resources")
        return real_bucket(tokens, *args)

    monkeypatch.setattr(moe_tuner, "tune_bucket", bucket_failing_at_two)
    configs = moe_tuner.tune([1, 2, 4], shape, w13, w2, None)
    assert sorted(configs) == [1, 4] and timed


@pytest.mark.parametrize("fp8", [False, True])
def test_tuning_times_descriptor_tiles_only_for_prefill_blocks_of_16_bit_weights(monkeypatch, fp8):
    """Tiles reading the weights through a tensor descriptor join the candidates from ``block_m`` 64 up (the
    compute-bound GEMMs), for 16- and 32-bit weights only: FP8 experts and rows of partial 16-byte units
    would refuse them."""
    from dovetail.triton import moe_tuner
    from dovetail.triton.moe_configs import LayerShape

    shape = LayerShape(experts=4, inter=32, hidden=64, top_k=2, dtype="bfloat16", quant="fp8" if fp8 else "none")
    w13 = torch.randn(4, 64, 64, device=DEVICE).bfloat16()
    w2 = torch.randn(4, 64, 32, device=DEVICE).bfloat16()
    scales = None
    if fp8:
        (w13, s13), (w2, s2) = quantize_experts(w13, None), quantize_experts(w2, None)
        scales = Fp8ExpertScales(s13, s2)
    timed = {}
    monkeypatch.setattr(moe_tuner, "_best", lambda candidates, run: (
        timed.setdefault(len(timed), candidates)[0], 1.0))
    moe_tuner.tune_bucket(256, shape, w13, w2, scales)  # 128 rows an expert: block_m 64, 32 and 128
    with_descriptor = [sum(c.tma for c in candidates) for candidates in timed.values()]
    if fp8:
        assert with_descriptor == [0] * 6
    else:
        halves = [len(candidates) // 2 for candidates in timed.values()]
        assert with_descriptor[:2] == halves[:2] and with_descriptor[4:] == halves[4:], "block_m 64 and 128"
        assert with_descriptor[2:4] == [0, 0], "block_m 32 keeps to tiles read by address"
    assert not moe_tuner.reads_through_descriptor(torch.empty(2, 8, 50, dtype=torch.bfloat16))
    assert not moe_tuner.reads_through_descriptor(torch.empty(2, 64, 8, dtype=torch.bfloat16).transpose(1, 2))


def test_routing_takes_one_program_only_for_the_tokens_of_one_tile(monkeypatch):
    """A few tokens are routed and aligned by one program; more, by many programs at once (routing one tile
    after another in a single program would be slower than the launch it saves)."""
    from dovetail.triton import moe_align

    launched = []
    for name in ("_align_small_kernel", "_route_count_kernel"):
        kernel = getattr(moe_align, name)
        monkeypatch.setattr(moe_align, name, type("Spy", (), {
            "__getitem__": lambda self, grid, k=kernel, n=name: (launched.append(n), k[grid])[1]})())
    for tokens in (32, 33):
        logits = torch.randn(tokens, 128, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
        weights, ids, _ = route_and_align(logits, 8, True, 128, 16)
        assert torch.equal(ids.long(), select_experts(logits, 8, True)[1].long())
    assert launched == ["_align_small_kernel", "_route_count_kernel"]
