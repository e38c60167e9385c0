"""Per-request block tables over the block pool, with prefix caching by chained block keys.

A full block's key is ``(parent key hash, its tokens)``: equal keys mean equal
tokens from the start of the sequence, so a hit can reuse the cached KV. The
first block's parent is the request's LoRA adapter id (None: the base model), as
an adapter computes other keys and values from the same tokens.
"""

from __future__ import annotations

from dovetail.engine.block_pool import Block, BlockPool
from dovetail.engine.request import Request


class KVCacheManager:
    """Allocates and frees the blocks of each request; finds cached prefixes."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.req_blocks: dict[str, list[Block]] = {}
        self.req_block_ids: dict[str, list[int]] = {}
        self.req_cached_blocks: dict[str, int] = {}  # leading blocks already entered in the prefix cache
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which were found

    # -- prefix cache ------------------------------------------------------------------

    def _block_keys(self, request: Request, num_full_blocks: int) -> list:
        keys = request.block_keys
        bs = self.block_size
        tokens = request.all_token_ids
        while len(keys) < num_full_blocks:
            i = len(keys)
            parent = hash(keys[-1]) if keys else (request.lora_request.lora_int_id if request.lora_request else None)
            keys.append((parent, tuple(tokens[i * bs:(i + 1) * bs])))
        return keys[:num_full_blocks]

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """The cached blocks that hold a prefix of the request's tokens (at least one token left to compute)."""
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return []
        # The last token must always be computed, to produce logits.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for key in self._block_keys(request, max_blocks):
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits

    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # -- allocation --------------------------------------------------------------------

    def blocks_needed(self, request: Request, num_new_tokens: int, cached: list[Block] | None = None) -> int:
        have = len(self.req_blocks.get(request.request_id, ())) + len(cached or ())
        total = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - have)

    def allocate(self, request: Request, num_new_tokens: int, cached: list[Block] | None = None) -> bool:
        """Give the request blocks for ``num_new_tokens`` more tokens; False (and no change) if they don't fit.

        ``cached`` are prefix-cache hits for a request starting from scratch.
        """
        need = self.blocks_needed(request, num_new_tokens, cached)
        # Sharing a cached block that is currently free takes it out of the free list.
        revived = sum(1 for b in cached or () if b.ref_cnt == 0)
        if need + revived > self.pool.num_free:
            return False
        rid = request.request_id
        blocks = self.req_blocks.setdefault(rid, [])
        ids = self.req_block_ids.setdefault(rid, [])
        for block in cached or ():
            self.pool.share(block)
        new_blocks = [*(cached or ()), *self.pool.allocate(need)]
        blocks.extend(new_blocks)
        ids.extend(b.block_id for b in new_blocks)
        if self.enable_prefix_caching:
            # Remember the blocks that will be full of known tokens once this step runs (only the new ones).
            full = min(request.num_computed_tokens + num_new_tokens, len(request.all_token_ids)) // self.block_size
            done = self.req_cached_blocks.get(rid, 0)
            if full > done:
                keys = self._block_keys(request, full)
                for i in range(done, full):
                    self.pool.cache(blocks[i], keys[i])
                self.req_cached_blocks[rid] = full
        return True

    def free(self, request: Request) -> None:
        """Release every block of the request at once; the tail is evicted first."""
        rid = request.request_id
        blocks = self.req_blocks.pop(rid, None)
        self.req_block_ids.pop(rid, None)
        self.req_cached_blocks.pop(rid, None)
        if blocks:
            self.pool.release(list(reversed(blocks)))

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (the manager's own list: do not modify it)."""
        return self.req_block_ids.get(request_id, [])

    def usage(self) -> float:
        return self.pool.usage()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (False, and nothing forgotten, while a request holds blocks)."""
        return self.pool.reset_prefix_cache()
