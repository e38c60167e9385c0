"""The (token, expert) pairs of a mixture-of-experts step, sorted by expert and padded to whole blocks, on the device.

Pair ``p = token * top_k + j`` goes to expert ``e = topk_ids[token, j]`` (through
``expert_map`` when given; pairs whose expert is held elsewhere go nowhere). The
result (:class:`AlignedPairs`) lists, expert after expert, each expert's pairs,
then padding up to a multiple of ``block_m`` marked with the sentinel
``num_pairs``; block ``b`` of ``block_m`` entries belongs to one expert,
``block_expert[b]``. The grouped GEMMs of :mod:`dovetail.triton.moe_gemm` run one
program per block and read these arrays on the device: nothing here is read on
the host, and every buffer's size follows from the token count alone, so a device
graph captures it.

Sizes: at most ``num_pairs + min(experts, num_pairs) * (block_m - 1)`` entries
(every expert with a pair pads fewer than ``block_m`` of them), rounded up to
whole blocks. Blocks past ``num_padded`` are not filled and the GEMMs skip them.

Within an expert the pairs come in no set order (each program claims its slots with atomic
additions); a pair's results do not depend on its place, so the layer's output is the same.

Two ways to count, chosen by the pair count (the results are the same):

- up to :data:`SMALL_PAIRS` pairs (decode steps) one program counts, places and pads;
- above it one program per chunk of pairs adds its pairs to the experts' counts, then
  one program per chunk lays the blocks out from the counts and places its pairs.

:func:`route_and_align` starts from the router's logits instead of ``topk_ids``: the programs
that count route their tokens first (:func:`dovetail.triton.moe_routing.route_tile`, the softmax
top-k), store the weights and ids and count the pairs from registers, so routing needs no launch
of its own.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dovetail.triton import next_power_of_2
from dovetail.triton.moe_routing import route_tile
from dovetail.triton.pdl import launch_kwargs, pdl_prologue, use_pdl

#: Most pairs aligned by the single-program kernel.
SMALL_PAIRS = 1024
#: Logits the single-program kernel routes at once (a tile of tokens by every expert, in registers).
ROUTE_TILE_LOGITS = 4096


class AlignedPairs(NamedTuple):
    """Device arrays the grouped GEMMs read (see the module docstring)."""

    sorted_pairs: torch.Tensor  # int32 [max_padded]: pair ids by expert, padding = num_pairs
    block_expert: torch.Tensor  # int32 [max_blocks]: the expert of each block (-1 past the end)
    num_padded: torch.Tensor  # int32 [1]: entries in use (a multiple of block_m)
    num_pairs: int
    block_m: int
    #: :func:`one_pair_per_block`'s layout: ``sorted_pairs`` is ``topk_ids`` itself and ``block_expert`` the
    #: expert map (or None), read by the GEMMs through ``has_map``.
    pair_per_block: bool = False
    has_map: bool = False

    @property
    def max_blocks(self) -> int:
        return self.num_pairs if self.pair_per_block else self.block_expert.shape[0]


def one_pair_per_block(topk_ids: torch.Tensor, block_m: int, expert_map: torch.Tensor | None = None) -> AlignedPairs:
    """A layout without a kernel, for one token: block ``p`` holds pair ``p`` alone (its ``top_k`` experts differ, so
    no expert's weights are read twice), its expert read from ``topk_ids`` by the GEMMs themselves."""
    ids = topk_ids.reshape(-1)
    return AlignedPairs(ids, expert_map if expert_map is not None else ids, ids, ids.numel(), block_m,
                        pair_per_block=True, has_map=expert_map is not None)


def max_padded(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Entries the sorted pairs may need at most (a multiple of ``block_m``)."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


@triton.jit
def _expert_of(ids_ptr, map_ptr, offs, ok, num_experts, HAS_MAP: tl.constexpr):
    """Each pair's expert row, or -1 (past the end, or held elsewhere)."""
    e = tl.load(ids_ptr + offs, mask=ok, other=-1).to(tl.int32)
    if HAS_MAP:
        e = tl.load(map_ptr + e, mask=ok & (e >= 0), other=-1).to(tl.int32)
    return tl.where((e >= 0) & (e < num_experts), e, -1)


@triton.jit
def _layout(counts, BLOCK_M: tl.constexpr):
    """Each expert's first slot and end, and the entries in use, from its pair count."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    return ends - padded, ends, tl.sum(padded, axis=0)


@triton.jit
def _write_layout(counts, starts, ends, total, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, max_blocks,
                  BLOCK_M: tl.constexpr, BLOCKS_TILE: tl.constexpr):
    """The padding entries, each block's expert and the entries in use."""
    tl.store(num_padded_ptr, total)
    for b0 in range(0, max_blocks, BLOCKS_TILE):
        blocks = b0 + tl.arange(0, BLOCKS_TILE)
        first = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(first < total, expert, -1), mask=blocks < max_blocks)
    pad = (starts + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ptr + pad, num_pairs, mask=pad < ends[:, None])


@triton.jit
def _route_and_count(logits_ptr, weights_ptr, ids_ptr, map_ptr, counts_ptr, rows, num_tokens, num_routed, num_experts,
                     stride_lt, HAS_MAP: tl.constexpr, TOP_K: tl.constexpr, K_P2: tl.constexpr,
                     RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, LOGITS_P2: tl.constexpr):
    """Route the tokens ``rows`` (their weights and expert ids stored) and add their pairs to the experts' counts."""
    e, keep = route_tile(logits_ptr, weights_ptr, ids_ptr, rows, num_tokens, num_routed, stride_lt, TOP_K, K_P2,
                         RENORMALIZE, BLOCK_T, LOGITS_P2)
    if HAS_MAP:
        e = tl.load(map_ptr + e, mask=keep, other=-1).to(tl.int32)
    e = tl.where(keep & (e >= 0) & (e < num_experts), e, -1)
    tl.atomic_add(counts_ptr + e, 1, mask=e >= 0)


@triton.jit(do_not_specialize=["num_pairs", "max_blocks", "num_tokens"])
def _align_small_kernel(ids_ptr, map_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, scratch_ptr,
                        num_pairs, num_experts, max_blocks, logits_ptr, weights_ptr, num_tokens, num_routed,
                        stride_lt, HAS_MAP: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                        CHUNK: tl.constexpr, BLOCKS_TILE: tl.constexpr, ROUTE: tl.constexpr, TOP_K: tl.constexpr,
                        K_P2: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                        LOGITS_P2: tl.constexpr, USE_PDL: tl.constexpr):
    """One program: count into ``scratch`` (routing the tokens first with ``ROUTE``), lay out, then claim each
    pair's slot from ``scratch``'s cursors."""
    pdl_prologue(USE_PDL)
    experts = tl.arange(0, E_P2)
    tl.store(scratch_ptr + experts, tl.zeros((E_P2,), dtype=tl.int32))
    tl.debug_barrier()
    if ROUTE:
        for t0 in range(0, num_tokens, BLOCK_T):
            _route_and_count(logits_ptr, weights_ptr, ids_ptr, map_ptr, scratch_ptr, t0 + tl.arange(0, BLOCK_T),
                             num_tokens, num_routed, num_experts, stride_lt, HAS_MAP, TOP_K, K_P2, RENORMALIZE,
                             BLOCK_T, LOGITS_P2)
    else:
        for start in range(0, num_pairs, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            e = _expert_of(ids_ptr, map_ptr, offs, offs < num_pairs, num_experts, HAS_MAP)
            tl.atomic_add(scratch_ptr + e, 1, mask=e >= 0)
    tl.debug_barrier()
    counts = tl.load(scratch_ptr + experts)
    starts, ends, total = _layout(counts, BLOCK_M)
    _write_layout(counts, starts, ends, total, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, max_blocks,
                  BLOCK_M, BLOCKS_TILE)
    tl.debug_barrier()
    tl.store(scratch_ptr + experts, starts)
    tl.debug_barrier()
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        e = _expert_of(ids_ptr, map_ptr, offs, offs < num_pairs, num_experts, HAS_MAP)
        slot = tl.atomic_add(scratch_ptr + e, 1, mask=e >= 0)
        tl.store(sorted_ptr + slot, offs, mask=e >= 0)


@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(ids_ptr, map_ptr, counts_ptr, num_pairs, num_experts, HAS_MAP: tl.constexpr,
                  CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    """Add this chunk's pairs to the experts' counts (``counts[:E_P2]``, zeroed before)."""
    pdl_prologue(USE_PDL)
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    e = _expert_of(ids_ptr, map_ptr, offs, offs < num_pairs, num_experts, HAS_MAP)
    tl.atomic_add(counts_ptr + e, 1, mask=e >= 0)


@triton.jit(do_not_specialize=["num_tokens"])
def _route_count_kernel(logits_ptr, weights_ptr, ids_ptr, map_ptr, counts_ptr, num_tokens, num_routed, num_experts,
                        stride_lt, HAS_MAP: tl.constexpr, TOP_K: tl.constexpr, K_P2: tl.constexpr,
                        RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, LOGITS_P2: tl.constexpr,
                        USE_PDL: tl.constexpr):
    """Route this tile of tokens and add their pairs to the experts' counts (``counts[:E_P2]``, zeroed before)."""
    pdl_prologue(USE_PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    _route_and_count(logits_ptr, weights_ptr, ids_ptr, map_ptr, counts_ptr, rows, num_tokens, num_routed, num_experts,
                     stride_lt, HAS_MAP, TOP_K, K_P2, RENORMALIZE, BLOCK_T, LOGITS_P2)


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _place_kernel(ids_ptr, map_ptr, counts_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs,
                  num_experts, max_blocks, HAS_MAP: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                  CHUNK: tl.constexpr, BLOCKS_TILE: tl.constexpr, USE_PDL: tl.constexpr):
    """Every program lays the blocks out from the counts (the first also writes the layout), then claims a slot
    for each pair of its chunk from the experts' fill counters (``counts[E_P2:]``, zeroed before)."""
    pdl_prologue(USE_PDL)
    experts = tl.arange(0, E_P2)
    counts = tl.load(counts_ptr + experts)
    starts, ends, total = _layout(counts, BLOCK_M)
    chunk = tl.program_id(0)
    if chunk == 0:
        _write_layout(counts, starts, ends, total, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs,
                      max_blocks, BLOCK_M, BLOCKS_TILE)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    e = _expert_of(ids_ptr, map_ptr, offs, offs < num_pairs, num_experts, HAS_MAP)
    valid = e >= 0
    base = tl.gather(starts, tl.where(valid, e, 0), 0)
    slot = base + tl.atomic_add(counts_ptr + E_P2 + e, 1, mask=valid)
    tl.store(sorted_ptr + slot, offs, mask=valid)


class Routing(NamedTuple):
    """Router logits ``[tokens, experts]`` for :func:`route_and_align`, with the buffers the routing fills."""

    logits: torch.Tensor
    top_k: int
    renormalize: bool
    weights: torch.Tensor  # float32 [tokens, top_k]
    ids: torch.Tensor  # int32 [tokens, top_k]


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int, expert_map: torch.Tensor | None = None,
                small_pairs: int = SMALL_PAIRS) -> AlignedPairs:
    """Sort and pad the pairs of ``topk_ids`` ``[tokens, top_k]`` by expert (``num_experts`` rows of weights)."""
    return _align(topk_ids.contiguous(), num_experts, block_m, expert_map, small_pairs, None)


def route_and_align(router_logits: torch.Tensor, top_k: int, renormalize: bool, num_experts: int, block_m: int,
                    expert_map: torch.Tensor | None = None, small_pairs: int | None = None):
    """:func:`~dovetail.triton.moe_routing.topk_softmax` and :func:`align_pairs` in the alignment's kernels (one
    launch fewer): ``(weights, ids, aligned)``. The routing is the same, computed by the programs that count.

    ``small_pairs`` (None: up to :data:`SMALL_PAIRS` pairs of tokens that one program routes in a single tile,
    :data:`ROUTE_TILE_LOGITS` logits) picks the one-program path; more tokens are routed by many programs at once.
    """
    tokens = router_logits.shape[0]
    if small_pairs is None:
        fits_one_tile = tokens * next_power_of_2(router_logits.shape[1]) <= ROUTE_TILE_LOGITS
        small_pairs = SMALL_PAIRS if fits_one_tile else 0
    device = router_logits.device
    routing = Routing(router_logits, top_k, renormalize,
                      torch.empty((tokens, top_k), dtype=torch.float32, device=device),
                      torch.empty((tokens, top_k), dtype=torch.int32, device=device))
    aligned = _align(routing.ids, num_experts, block_m, expert_map, small_pairs, routing)
    return routing.weights, routing.ids, aligned


def _align(ids: torch.Tensor, num_experts: int, block_m: int, expert_map: torch.Tensor | None, small_pairs: int,
           routing: Routing | None) -> AlignedPairs:
    device = ids.device
    num_pairs = ids.numel()
    e_p2 = next_power_of_2(num_experts)
    padded = max_padded(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(padded, dtype=torch.int32, device=device)
    block_expert = torch.empty(padded // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    has_map = expert_map is not None
    map_arg = expert_map if has_map else ids
    pdl = launch_kwargs(use_pdl(device))
    blocks_tile = max(16, min(128, 4096 // e_p2))
    if routing is not None:
        tokens, routed = routing.logits.shape
        logits_p2 = next_power_of_2(routed)
        route_args = (routing.logits, routing.weights, tokens, routed, routing.logits.stride(0))
        route_flags = dict(TOP_K=routing.top_k, K_P2=next_power_of_2(routing.top_k),
                           RENORMALIZE=routing.renormalize, LOGITS_P2=logits_p2)
    else:
        tokens, logits_p2 = 0, 1
        route_args = (ids, ids, 0, 0, 0)
        route_flags = dict(TOP_K=1, K_P2=1, RENORMALIZE=False, LOGITS_P2=1)
    if num_pairs <= small_pairs:
        scratch = torch.empty(e_p2, dtype=torch.int32, device=device)  # zeroed by the kernel: no memset launch
        _align_small_kernel[(1,)](
            ids, map_arg, sorted_pairs, block_expert, num_padded, scratch,
            num_pairs, num_experts, block_expert.shape[0], *route_args, HAS_MAP=has_map, E_P2=e_p2, BLOCK_M=block_m,
            CHUNK=256, BLOCKS_TILE=blocks_tile, ROUTE=routing is not None,
            BLOCK_T=max(1, min(next_power_of_2(max(tokens, 1)), ROUTE_TILE_LOGITS // logits_p2)), **route_flags,
            num_warps=8, **pdl)
    else:
        counts = torch.zeros(2 * e_p2, dtype=torch.int32, device=device)  # the counts, then the fill counters
        chunk = 1024
        num_chunks = triton.cdiv(num_pairs, chunk)
        if routing is None:
            _count_kernel[(num_chunks,)](ids, map_arg, counts, num_pairs, num_experts, HAS_MAP=has_map, CHUNK=chunk,
                                         num_warps=8, **pdl)
        else:
            block_t = max(1, min(next_power_of_2(tokens), 2048 // logits_p2))
            _route_count_kernel[(triton.cdiv(tokens, block_t),)](
                routing.logits, routing.weights, ids, map_arg, counts, tokens, routed, num_experts,
                routing.logits.stride(0), HAS_MAP=has_map, BLOCK_T=block_t, **route_flags,
                num_warps=4 if block_t * logits_p2 >= 2048 else 1, **pdl)
        _place_kernel[(num_chunks,)](ids, map_arg, counts, sorted_pairs, block_expert, num_padded, num_pairs,
                                     num_experts, block_expert.shape[0], HAS_MAP=has_map, E_P2=e_p2,
                                     BLOCK_M=block_m, CHUNK=chunk, BLOCKS_TILE=blocks_tile, num_warps=8, **pdl)
    return AlignedPairs(sorted_pairs, block_expert, num_padded, num_pairs, block_m)
