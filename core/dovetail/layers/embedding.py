"""Vocabulary embedding and LM head (tied to the embedding or not), split by vocabulary among ranks.

Under tensor parallelism each rank holds ``ceil(vocab / tp_size)`` consecutive
rows of the table (the last rank's tail is padding), as vLLM's
``VocabParallelEmbedding`` does. The embedding looks up the tokens in its range,
zeroes the rest and sums over the ranks with an all-reduce; the LM head computes
the logits of its rows and all-gathers them, for the rows the runner samples
only (it calls :meth:`LMHead.forward` on those); a greedy step needs only each
rank's best logit and its index (:meth:`LMHead.greedy_tokens`). With one rank
neither communicates and the table is the checkpoint's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dovetail.checkpoint_tensor import read
from dovetail.distributed import all_gather, all_reduce, tp_rank, tp_size
from dovetail.errors import ModelLoadError
from dovetail.model_interface import ModelContext


class VocabShard:
    """The rows of a ``vocab_size``-row table this rank holds: ``[start, end)``, in a table of ``rows``."""

    def __init__(self, vocab_size: int):
        size, rank = tp_size(), tp_rank()
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // size)
        self.start = min(rank * self.rows, vocab_size)
        self.end = min(self.start + self.rows, vocab_size)
        self.split = size > 1

    def load(self, param: nn.Parameter, tensor, name: str) -> None:
        """Copy this rank's rows of checkpoint ``tensor`` ``[vocab, hidden]`` (only they are read); zero the padding."""
        expected = (self.vocab_size, param.shape[1])
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, but the vocabulary table "
                                 f"expects {expected}")
        count = self.end - self.start
        param.data[:count].copy_(read(tensor.narrow(0, self.start, count)))
        param.data[count:].zero_()


class VocabEmbedding(nn.Module):
    """Token embedding table ``[vocab, hidden]`` (this rank's rows under tensor parallelism).

    ``scale`` multiplies the embeddings (Gemma's ``sqrt(hidden_size)``); like HF,
    the factor is first rounded to the model's dtype.
    """

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ModelContext, scale: float | None = None):
        super().__init__()
        self.shard = VocabShard(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.shard.rows, hidden_size, dtype=ctx.dtype), requires_grad=False)
        if self.shard.split:
            self.weight.weight_loader = self._load
        self.scale = None if scale is None else torch.tensor(scale, dtype=torch.float32).to(ctx.dtype).item()

    def _load(self, param: nn.Parameter, tensor, shard: int | None) -> None:
        self.shard.load(param, tensor, "embedding")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard.split:
            local = input_ids - self.shard.start
            outside = (local < 0) | (local >= self.shard.end - self.shard.start)
            embeddings = F.embedding(local.masked_fill(outside, 0), self.weight)
            embeddings = all_reduce(embeddings.masked_fill_(outside.unsqueeze(-1), 0))
        else:
            embeddings = F.embedding(input_ids, self.weight)
        return embeddings if self.scale is None else embeddings * self.scale


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits; shares the embedding's weight when tied.

    ``final_logit_softcap`` applies ``c * tanh(logits / c)`` (Gemma 2). Under
    tensor parallelism each rank computes its rows' logits and they are gathered,
    so every rank returns the whole ``[rows, vocab]``; ``forward(h, gather=False)``
    keeps this rank's columns, for :meth:`greedy_tokens` or a later :meth:`gather`.
    """

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ModelContext,
                 tied_to: VocabEmbedding | None = None, final_logit_softcap: float | None = None):
        super().__init__()
        self.tied = tied_to is not None
        self.shard = VocabShard(vocab_size)
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(self.shard.rows, hidden_size, dtype=ctx.dtype),
                                       requires_grad=False)
            if self.shard.split:
                self.weight.weight_loader = self._load
        self.final_logit_softcap = final_logit_softcap
        self.ops = ctx.ops
        #: Gathered logits have padding columns past the vocabulary to drop.
        self.padded = self.shard.rows * tp_size() != vocab_size

    def _load(self, param: nn.Parameter, tensor, shard: int | None) -> None:
        self.shard.load(param, tensor, "lm_head")

    def forward(self, hidden_states: torch.Tensor, gather: bool = True) -> torch.Tensor:
        logits = self.ops.linear(hidden_states, self.weight)
        if self.final_logit_softcap:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return self.gather(logits) if gather else logits

    def gather(self, local_logits: torch.Tensor) -> torch.Tensor:
        """The whole ``[rows, vocab]`` from every rank's ``forward(h, gather=False)`` columns."""
        if not self.shard.split:
            return local_logits
        logits = all_gather(local_logits, dim=-1)
        return logits[..., :self.shard.vocab_size] if self.padded else logits

    def greedy_tokens(self, local_logits: torch.Tensor) -> torch.Tensor:
        """The argmax over the whole vocabulary of each row (int64 ``[rows]``), from this rank's columns: each
        rank's largest logit and its index are gathered (two numbers a row, not ``vocab``) and the first rank
        with the largest wins, which is the first maximum of the gathered row, as ``argmax`` would take it."""
        if not self.shard.split:
            return local_logits.argmax(dim=-1)
        count = self.shard.end - self.shard.start  # the padding columns past the vocabulary never win
        rows = local_logits.shape[0]
        if count > 0:
            values, index = local_logits[:, :count].max(dim=-1)
        else:
            values = torch.full((rows,), float("-inf"), device=local_logits.device)
            index = torch.zeros(rows, dtype=torch.long, device=local_logits.device)
        # Token ids below 2**24 are exact in float32, so one tensor carries both.
        best = torch.stack([values.float(), (index + self.shard.start).float()], dim=-1)
        everyone = all_gather(best.unsqueeze(0), dim=0)  # [ranks, rows, 2]
        winner = everyone[..., 0].argmax(dim=0, keepdim=True)
        return everyone[..., 1].gather(0, winner).squeeze(0).long()
