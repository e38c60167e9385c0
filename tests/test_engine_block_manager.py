"""KV-cache block manager properties, checked with hypothesis: no leak, no double free, ref counts, LRU."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dovetail.engine.block_pool import BlockPool
from dovetail.engine.kv_cache_manager import KVCacheManager
from dovetail.engine.request import Request
from dovetail.sampling_params import SamplingParams

BLOCK = 4


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, None, tokens, SamplingParams(max_tokens=4), eos_token_ids=set())


def _check_invariants(kv: KVCacheManager):
    refs = Counter(b.block_id for blocks in kv.req_blocks.values() for b in blocks)
    for block in kv.pool.blocks:
        assert block.ref_cnt == refs.get(block.block_id, 0), f"ref count of {block} disagrees with the tables"
    free_ids = set(kv.pool._free)
    assert free_ids == {b.block_id for b in kv.pool.blocks if b.ref_cnt == 0}
    for key, block in kv.pool._cached.items():
        assert block.key == key, "a cached block must carry its own key"
    for blocks in kv.req_blocks.values():
        assert len({b.block_id for b in blocks}) == len(blocks), "a request holds a block twice"


ops = st.lists(st.tuples(st.sampled_from(["start", "grow", "free"]), st.integers(0, 5),
                         st.lists(st.integers(0, 2), min_size=1, max_size=14)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(4, 24), st.booleans())
def test_random_operations_keep_the_books_balanced(operations, num_blocks, caching):
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=caching)
    live: dict[str, Request] = {}
    for op, slot, tokens in operations:
        rid = f"r{slot}"
        if op == "start" and rid not in live:
            req = _request(rid, tokens)
            cached = kv.find_cached_prefix(req)
            req.num_computed_tokens = len(cached) * BLOCK
            assert req.num_computed_tokens < req.num_tokens, "a hit must leave a token to compute"
            if kv.allocate(req, req.num_tokens - req.num_computed_tokens, cached):
                req.num_computed_tokens = req.num_tokens
                live[rid] = req
            else:
                req.num_computed_tokens = 0
                assert rid not in kv.req_blocks, "a failed allocation must change nothing"
        elif op == "grow" and rid in live:
            req = live[rid]
            req.append_token(tokens[0])
            if kv.allocate(req, 1):
                req.num_computed_tokens += 1
        elif op == "free" and rid in live:
            kv.free(live.pop(rid))
        _check_invariants(kv)
    for req in live.values():
        kv.free(req)
    _check_invariants(kv)
    assert kv.pool.num_free == num_blocks, "every block must come back once all requests are freed"


def test_double_free_is_detected():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.release(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.release(blocks[:1])


def test_shared_prefix_blocks_are_reference_counted():
    kv = KVCacheManager(16, BLOCK)
    a = _request("a", list(range(10)))
    assert kv.allocate(a, 10)
    a.num_computed_tokens = 10
    b = _request("b", list(range(10)) + [99])
    hits = kv.find_cached_prefix(b)
    assert [h.block_id for h in hits] == kv.block_ids("a")[:2]
    b.num_computed_tokens = len(hits) * BLOCK
    assert kv.allocate(b, b.num_tokens - b.num_computed_tokens, hits)
    assert all(blk.ref_cnt == 2 for blk in hits)
    kv.free(a)
    assert all(blk.ref_cnt == 1 for blk in hits)
    kv.free(b)
    assert kv.pool.num_free == 16


def test_reset_forgets_every_cached_block_but_only_when_none_is_in_use():
    kv = KVCacheManager(16, BLOCK)
    a = _request("a", list(range(10)))
    assert kv.allocate(a, 10)
    assert not kv.reset_prefix_cache() and kv.pool.num_cached() == 2
    kv.free(a)
    assert kv.reset_prefix_cache() and kv.pool.num_cached() == 0
    assert kv.find_cached_prefix(_request("b", list(range(10)))) == []
    _check_invariants(kv)


def test_eviction_takes_least_recently_freed_first_and_tail_first():
    kv = KVCacheManager(6, BLOCK)
    a = _request("a", list(range(12)))  # three full blocks
    assert kv.allocate(a, 12)
    a_blocks = kv.block_ids("a")
    kv.free(a)
    # Freed tail first: the free list now ends with a's blocks in reverse order.
    order = list(kv.pool._free)
    assert order[-3:] == list(reversed(a_blocks))
    # Three never-used blocks are taken before any cached one.
    taken = kv.pool.allocate(3)
    assert not set(b.block_id for b in taken) & set(a_blocks)
    # The next allocation evicts a's last block first, which drops it from the prefix cache.
    evicted = kv.pool.allocate(1)[0]
    assert evicted.block_id == a_blocks[-1] and evicted.key is None
    again = _request("again", list(range(12)) + [7])
    assert [b.block_id for b in kv.find_cached_prefix(again)] == a_blocks[:2]


def test_full_hit_still_computes_the_last_token():
    kv = KVCacheManager(8, BLOCK)
    a = _request("a", list(range(8)))
    assert kv.allocate(a, 8)
    twin = _request("twin", list(range(8)))
    hits = kv.find_cached_prefix(twin)
    assert len(hits) == 1, "with 8 tokens only the first block may be reused (the last token must run)"


def test_prefix_key_covers_every_earlier_token():
    kv = KVCacheManager(8, BLOCK)
    a = _request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.allocate(a, 9)
    other = _request("o", [0, 2, 3, 4, 5, 6, 7, 8, 9])  # same second block, different first block
    assert kv.find_cached_prefix(other) == []
