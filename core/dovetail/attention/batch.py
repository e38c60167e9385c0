"""The engine's description of one step's batch, as every attention backend receives it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dovetail.device_copy import to_device, values_to_device


@dataclass
class AttentionBatch:
    """The flattened mixed prefill/decode batch of one step.

    Device tensors (on the platform's device):

    - ``query_start_loc``: int32 ``[num_seqs + 1]``, cumulative query lengths.
    - ``seq_lens``: int32 ``[num_seqs]``, context length of each sequence
      *including* this step's tokens.
    - ``block_table``: int32 ``[num_seqs, max_blocks]``, the cache blocks of each
      sequence in order, padded with 0.
    - ``slot_mapping``: int64 ``[num_tokens]``, where each new token's key and
      value go (``-1``: do not write).

    ``*_cpu`` are the same on the host, for backends that plan on the CPU
    (``block_table_cpu`` may be None when a caller does not have it).
    Sequences with a query length of 1 come first (``num_decodes`` of them).
    """

    num_tokens: int
    num_seqs: int
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_size: int
    block_table_cpu: torch.Tensor | None = None

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @property
    def context_lens_cpu(self) -> torch.Tensor:
        """Tokens already in the cache before this step, per sequence."""
        return self.seq_lens_cpu - self.query_lens_cpu

    @classmethod
    def from_lists(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                   block_size: int, device: torch.device | str = "cpu") -> "AttentionBatch":
        """Build a batch from per-sequence lists (tests and simple runners).

        ``query_lens[i]`` new tokens of sequence ``i`` occupy its last positions;
        their slots follow from its block table.
        """
        slots = [table[pos // block_size] * block_size + pos % block_size
                 for q, s, table in zip(query_lens, seq_lens, block_tables) for pos in range(s - q, s)]
        return cls.build(query_lens, seq_lens, block_tables, slots, block_size, device)

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              slots: list[int], block_size: int, device: torch.device | str = "cpu") -> "AttentionBatch":
        """Build a batch from per-sequence lists and the slot of every new token."""
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        width = max((len(t) for t in block_tables), default=1) or 1
        table = torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        num_decodes = 0
        for q in query_lens:
            if q != 1:
                break
            num_decodes += 1
        qsl_cpu = torch.tensor(qsl, dtype=torch.int32)
        seq_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        return cls(
            num_tokens=qsl[-1], num_seqs=len(query_lens), num_decodes=num_decodes,
            max_query_len=max(query_lens, default=0), max_seq_len=max(seq_lens, default=0),
            query_start_loc=to_device(qsl_cpu, device),
            seq_lens=to_device(seq_cpu, device),
            block_table=to_device(table, device),
            slot_mapping=values_to_device(slots, torch.long, device),
            query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_cpu, block_size=block_size, block_table_cpu=table,
        )
