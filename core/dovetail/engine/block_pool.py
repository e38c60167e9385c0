"""The pool of KV-cache blocks: reference counts, prefix-cache lookup and LRU eviction.

A free block keeps its cached contents (and its entry in the prefix cache)
until it is reused; free blocks are reused least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable


class Block:
    """One block of ``block_size`` token slots in every layer's KV cache."""

    __slots__ = ("block_id", "ref_cnt", "key")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.key: Hashable | None = None

    def __repr__(self):
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.key is not None})"


class BlockPool:
    """Allocates, shares and frees blocks; remembers full blocks by their chained key."""

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (got {num_blocks})")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[Hashable, Block] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def lookup(self, key: Hashable) -> Block | None:
        return self._cached.get(key) if self.enable_caching else None

    def allocate(self, count: int) -> list[Block]:
        """Take ``count`` free blocks, evicting the least recently freed cached ones."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks with only {len(self._free)} free")
        taken = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            if block.key is not None:
                if self._cached.get(block.key) is block:
                    del self._cached[block.key]
                block.key = None
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def share(self, block: Block) -> None:
        """Add a reference to a cached block (a prefix-cache hit)."""
        if block.ref_cnt == 0:
            del self._free[block.block_id]
        block.ref_cnt += 1

    def release(self, blocks: list[Block]) -> None:
        """Drop one reference from each block; unreferenced ones become free, in the given order."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache(self, block: Block, key: Hashable) -> None:
        """Record that ``block`` holds the full block identified by ``key``."""
        if not self.enable_caching or block.key is not None:
            return
        if key not in self._cached:
            self._cached[key] = block
            block.key = key

    def num_cached(self) -> int:
        return len(self._cached)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.key = None
        self._cached.clear()
        return True
