"""A worker's mirror of one running sequence, which the model runner and the sampler read.

Its own module so that the worker, the runner and the sampler all name it without importing one another.
"""

from __future__ import annotations

from dovetail.engine.request import SequenceTokens
from dovetail.engine.step import NewRequestData
from dovetail.sampling_params import SamplingParams


class RequestState(SequenceTokens):
    """A worker's mirror of one sequence: what the model runner and the sampler read.

    ``all_token_ids`` are the tokens this worker knows; ``num_pending`` more were
    sampled on the device and are known once the engine takes the step's output,
    the newest being row ``pending_row`` of the last step's tokens.
    """

    __slots__ = ("request_id", "params", "eos_token_ids", "prompt_token_ids", "all_token_ids",
                 "output_token_ids", "num_computed_tokens", "num_pending", "pending_row", "block_ids",
                 "pooled", "lora_id", "lora_slot", "draft_token_ids")

    def __init__(self, data: NewRequestData):
        self.request_id = data.request_id
        self.params: SamplingParams = data.params
        self.eos_token_ids = data.eos_token_ids
        self.prompt_token_ids = data.prompt_token_ids
        self.all_token_ids = [*data.prompt_token_ids, *data.output_token_ids]
        self.output_token_ids = list(data.output_token_ids)
        self.num_computed_tokens = data.num_computed_tokens
        self.num_pending = 0
        self.pending_row = -1
        self.block_ids = list(data.block_ids)
        #: The pooling runner's state between the chunks of the prompt (:class:`dovetail.engine.pooler.Pooler`).
        self.pooled = None
        #: The LoRA adapter's id (0: the base model) and the slot holding it (-1: none), set by the worker.
        self.lora_id = data.lora_request.lora_int_id if data.lora_request is not None else 0
        self.lora_slot = -1
        #: The draft tokens this step computes after the last known token (speculative decoding), else [].
        self.draft_token_ids: list[int] = []
