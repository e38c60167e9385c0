"""Vocabulary embedding and LM head (tied to the embedding or not), split by vocabulary among ranks.

Under tensor parallelism each rank holds ``ceil(vocab / tp_size)`` consecutive
rows of the table (the last rank's tail is padding), as vLLM's
``VocabParallelEmbedding`` does. The embedding looks up the tokens in its range,
zeroes the rest and sums over the ranks with an all-reduce; the LM head computes
the logits of its rows and all-gathers them, for the rows the runner samples
only (it calls :meth:`LMHead.forward` on those). With one rank neither
communicates and the table is the checkpoint's.
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
    so every rank returns the whole ``[rows, vocab]``.
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

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.ops.linear(hidden_states, self.weight)
        if self.final_logit_softcap:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        if self.shard.split:
            logits = all_gather(logits, dim=-1)
            if self.padded:
                logits = logits[..., :self.shard.vocab_size]
        return logits
