"""What crosses the seam between the engine and its workers, each step, in both directions.

The engine sends a :class:`StepDescription`: a request in full the first time
the workers see it (:class:`NewRequestData`), afterwards only the blocks it
gained and how many tokens it computes. The workers keep their own mirror of
each request (its tokens, sampling parameters and progress) and add the tokens
they sample themselves, so the description never carries the tokens of a
running request, but for the draft tokens of speculative decoding. Everything
here is plain data: it pickles for worker processes and Ray actors, and costs
nothing to hand over in process.

A worker answers each step with a :class:`StepOutput`: the sampled tokens, in
the order of the rows that sampled, and the logprobs that were asked for (a
pooling model: the pooled hidden states of the prompts the step completed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from dovetail.device_copy import to_device, values_to_device
from dovetail.lora.request import LoRARequest
from dovetail.sampling_params import SamplingParams

#: Per sampled row: (the sampled token's logprob, its rank, the top ``logprobs`` as ``(token, logprob)``).
TokenLogprobs = tuple[float, int, list[tuple[int, float]]]


@dataclass
class NewRequestData:
    """A request the workers do not know yet (new, or resumed after a preemption dropped it)."""

    request_id: str
    prompt_token_ids: list[int]
    #: Tokens generated before (a preempted request keeps them and recomputes their KV).
    output_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    block_ids: list[int]
    #: Tokens whose KV is already in the cache (prefix-cache hits).
    num_computed_tokens: int
    #: The LoRA adapter the request runs with (added to the workers before), else None.
    lora_request: Optional[LoRARequest] = None


@dataclass
class StepDescription:
    """One step's work for every worker.

    ``request_ids`` and ``num_new_tokens`` give the batch in order (single-token
    rows first); a row samples when it reaches the end of its known and pending
    tokens. Before running it, a worker forgets ``finished_request_ids``
    (finished, aborted or preempted), adds ``new_requests`` and appends
    ``new_block_ids`` to the tables of the requests that gained blocks.
    """

    request_ids: list[str]
    num_new_tokens: list[int]
    new_requests: list[NewRequestData] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    finished_request_ids: list[str] = field(default_factory=list)
    #: Allowed tokens per constrained row, packed 32 to an int32 word (``[rows, ceil(vocab / 32)]``,
    #: bit ``t % 32`` of word ``t // 32``, as xgrammar fills them), applied to the logits before
    #: sampling; None when no row is constrained (structured outputs).
    token_bitmask: Optional[torch.Tensor] = None
    #: The sampled rows (in sampling order) that ``token_bitmask``'s rows constrain; None: all of them.
    bitmask_rows: Optional[list[int]] = None
    #: Run the model but wait for :meth:`Worker.sample_with_bitmask` to sample (the engine builds the
    #: bitmask meanwhile, from tokens the step before is still bringing back).
    sample_later: bool = False
    #: Speculative decoding: the draft tokens each such request computes after its last token this step
    #: (its row is ``1 + len(drafts)`` tokens, and samples at each of them: :mod:`dovetail.engine.speculative`).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class StepOutput:
    """What a worker sampled in one step (the driver rank's answer; the others answer nothing)."""

    token_ids: list[int]
    #: Per sampled row, or None for rows that did not ask for logprobs.
    logprobs: list[Optional[TokenLogprobs]]
    #: Per request that asked for prompt logprobs: the prompt positions predicted and, for each,
    #: the prompt token's logprob, its rank and the top ``prompt_logprobs`` as ``(token, logprob)``.
    prompt_logprobs: dict[str, tuple[list[int], list[TokenLogprobs]]] = field(default_factory=dict)
    #: A pooling model's answer instead of tokens: the pooled hidden states ``[rows, hidden]`` (float32) of
    #: the requests whose prompt the step completed, in batch order; None when none did.
    embeddings: Optional[np.ndarray] = None
    #: Speculative rows (by their index in ``token_ids``) that yield more than one token: the tokens after the
    #: first, each with its logprobs (or None), in order.
    draft_rows: dict[int, list[tuple[int, Optional[TokenLogprobs]]]] = field(default_factory=dict)


EMPTY_OUTPUT = StepOutput([], [])


#: xgrammar's kernel per device type; elsewhere its plain torch one. (Its CPU kernel writes one logit past
#: the vocabulary when the vocabulary is not a multiple of 32: into the next row, or past the tensor.)
BITMASK_KERNELS = {"cuda": "triton"}


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Optional[list[int]] = None,
                        vocab_size: Optional[int] = None) -> None:
    """Set to ``-inf``, in place, the logits of tokens whose bit is 0 in ``bitmask`` (see
    :attr:`StepDescription.token_bitmask`): row ``i`` of ``bitmask`` constrains row ``rows[i]`` of ``logits``
    (default: row ``i``); the other rows are left alone, at no cost. Only the first ``vocab_size`` columns
    (default: all) are the vocabulary; padding columns beyond it are left alone."""
    import xgrammar as xgr

    backend = BITMASK_KERNELS.get(logits.device.type, "torch_native")
    vocab_size = logits.shape[-1] if vocab_size is None else vocab_size
    bitmask = to_device(bitmask, logits.device)
    if rows is None or len(rows) == logits.shape[0]:
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, backend=backend)
        return
    full = torch.empty((logits.shape[0], bitmask.shape[1]), dtype=bitmask.dtype, device=logits.device)
    full.index_copy_(0, values_to_device(rows, torch.long, logits.device), bitmask)
    xgr.apply_token_bitmask_inplace(logits, full, vocab_size=vocab_size, indices=rows, backend=backend)
