"""Vocabulary embedding and LM head (tied to the embedding or not)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dovetail.model_interface import ModelContext


class VocabEmbedding(nn.Module):
    """Token embedding table ``[vocab, hidden]``.

    ``scale`` multiplies the embeddings (Gemma's ``sqrt(hidden_size)``); like HF,
    the factor is first rounded to the model's dtype.
    """

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ModelContext, scale: float | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=ctx.dtype), requires_grad=False)
        self.scale = None if scale is None else torch.tensor(scale, dtype=torch.float32).to(ctx.dtype).item()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeddings = F.embedding(input_ids, self.weight)
        return embeddings if self.scale is None else embeddings * self.scale


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits; shares the embedding's weight when tied.

    ``final_logit_softcap`` applies ``c * tanh(logits / c)`` (Gemma 2).
    """

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ModelContext,
                 tied_to: VocabEmbedding | None = None, final_logit_softcap: float | None = None):
        super().__init__()
        self.tied = tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=ctx.dtype), requires_grad=False)
        self.final_logit_softcap = final_logit_softcap
        self.ops = ctx.ops

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.ops.linear(hidden_states, self.weight)
        if self.final_logit_softcap:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits
