"""The pooling runner's last step: a prompt's final hidden states become one vector.

A prompt may be computed over several steps (chunked prefill); the pooler keeps what it needs between
them on the request's mirror (the running sum for ``MEAN``, the first token's state for ``CLS``) and
answers, in batch order, for the requests whose prompt the step completes. Vectors stay raw here:
the engine truncates and normalises them per request (:func:`dovetail.pooling.finish_embedding`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dovetail.device_copy import values_to_device

if TYPE_CHECKING:
    from dovetail.engine.request_state import RequestState
    from dovetail.engine.scheduler import ScheduledBatch


class Pooler:
    """Pools the hidden states of the prompts a step completes (``LAST``, ``MEAN`` or ``CLS``)."""

    def __init__(self, pooling_type: str):
        if pooling_type not in ("LAST", "MEAN", "CLS"):
            raise ValueError(f"pooling_type: {pooling_type!r} is not LAST, MEAN or CLS")
        self.pooling_type = pooling_type

    def pool(self, batch: ScheduledBatch, hidden: torch.Tensor) -> tuple[list[RequestState], torch.Tensor | None]:
        """The requests whose prompt this step completes, and their pooled states ``[rows, hidden]`` (float32,
        on the device; None when no prompt completes)."""
        starts, ends, done = [], [], []
        offset = 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            starts.append(offset)
            offset += n
            ends.append(offset)
            done.append(req.num_computed_tokens + n == req.num_prompt_tokens)
        if self.pooling_type == "MEAN":
            sums = self._segment_sums(hidden, batch.num_new_tokens)
        finished, rows = [], []
        for i, req in enumerate(batch.requests):
            if self.pooling_type == "MEAN":
                total = sums[i] if req.pooled is None else req.pooled + sums[i]
                if done[i]:
                    rows.append(total / req.num_prompt_tokens)
                else:
                    req.pooled = total
            elif self.pooling_type == "CLS":
                if req.num_computed_tokens == 0:
                    req.pooled = hidden[starts[i]].float()
                if done[i]:
                    rows.append(req.pooled)
            elif done[i]:
                rows.append(hidden[ends[i] - 1].float())
            if done[i]:
                finished.append(req)
        return finished, (torch.stack(rows) if rows else None)

    @staticmethod
    def _segment_sums(hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Per request, the float32 sum of its rows of ``hidden`` (one kernel for the whole step)."""
        owner = values_to_device([i for i, n in enumerate(lengths) for _ in range(n)], torch.long, hidden.device)
        sums = torch.zeros((len(lengths), hidden.shape[-1]), dtype=torch.float32, device=hidden.device)
        return sums.index_add_(0, owner, hidden[:owner.numel()].float())
