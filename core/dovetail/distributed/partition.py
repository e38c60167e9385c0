"""How sizes split among the tensor-parallel ranks, and the errors when they cannot.

A :class:`Part` says which of ``count`` equal parts of a dimension this rank keeps:
a column-parallel layer keeps part ``rank`` of ``tp_size`` of its outputs; a
key/value projection with fewer KV heads than ranks keeps the part of head
``rank // (tp_size / num_kv_heads)``, so those heads are replicated as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from dovetail.distributed.parallel_state import tp_rank, tp_size
from dovetail.errors import ConfigError


def divide(total: int, what: str, parts: int | None = None) -> int:
    """``total / parts`` (default: the tensor-parallel size); a one-line error naming both when it is not whole."""
    parts = tp_size() if parts is None else parts
    if total % parts:
        raise ConfigError(f"{what} {total} is not divisible by tensor_parallel_size {parts}")
    return total // parts


@dataclass(frozen=True)
class Part:
    """Part ``index`` of ``count`` equal parts of a dimension; ``Part(1, 0)`` is the whole."""

    count: int = 1
    index: int = 0

    @property
    def whole(self) -> bool:
        return self.count == 1

    def of(self, length: int, what: str) -> tuple[int, int]:
        """(start, length) of this part of ``length`` elements; an error naming both when they do not split."""
        if length % self.count:
            raise ConfigError(f"{what}: {length} elements do not split into {self.count} equal parts "
                              f"(tensor_parallel_size {tp_size()})")
        size = length // self.count
        return self.index * size, size


WHOLE = Part()


def rank_part() -> Part:
    """This rank's part of a dimension split evenly among every rank."""
    return Part(tp_size(), tp_rank())


def kv_head_part(num_kv_heads: int) -> tuple[int, Part]:
    """(KV heads this rank holds, its part of the checkpoint's KV heads).

    With at least as many KV heads as ranks they are divided; with fewer, each rank
    holds one head, shared by ``tp_size / num_kv_heads`` consecutive ranks.
    """
    size, rank = tp_size(), tp_rank()
    if num_kv_heads >= size:
        return divide(num_kv_heads, "num_key_value_heads"), rank_part()
    if size % num_kv_heads:
        raise ConfigError(f"tensor_parallel_size {size} is not divisible by num_key_value_heads {num_kv_heads} "
                          "(with fewer KV heads than ranks, each head is replicated on an equal number of ranks)")
    return 1, Part(num_kv_heads, rank // (size // num_kv_heads))
