"""The sampled rows' logits as one rank holds them under tensor parallelism: its columns of the vocabulary.

Gathering every rank's columns moves ``rows x vocab`` values a step (32 MB at 256 rows of Llama 3's
128,256 tokens in bfloat16); a step whose rows are all plain greedy needs only each rank's best logit and
its index (:meth:`dovetail.layers.embedding.LMHead.greedy_tokens`). Anything else (sampling, penalties,
logprobs, a grammar's bitmask) gathers the whole rows first. The calls are collectives: every rank makes the
same ones, which holds because every rank samples the same rows with the same parameters.
"""

from __future__ import annotations

from typing import Optional

import torch


class ShardedLogits:
    """This rank's columns ``local`` of the sampled rows' logits, from ``head`` (an
    :class:`~dovetail.layers.embedding.LMHead` split among the ranks), with their greedy tokens when already
    computed (a decode graph computes them with the logits)."""

    def __init__(self, head, local: torch.Tensor, greedy: Optional[torch.Tensor] = None):
        self.head, self.local, self._greedy = head, local, greedy

    def greedy_tokens(self) -> torch.Tensor:
        """The argmax of each whole row (int64 ``[rows]``)."""
        if self._greedy is None:
            self._greedy = self.head.greedy_tokens(self.local)
        return self._greedy

    def gather(self) -> torch.Tensor:
        """The whole rows ``[rows, vocab]``."""
        return self.head.gather(self.local)
