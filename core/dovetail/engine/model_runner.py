"""Runs the model once per step over the flattened mixed prefill/decode batch.

It owns the KV caches (one tensor per attention layer, shaped by the backend),
builds the step's :class:`AttentionBatch` and the backend's metadata, runs the
forward, and computes logits only for the rows where a token is sampled (plus
the prompt rows of requests that asked for prompt logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dovetail.attention.backend import AttentionBackend
from dovetail.attention.batch import AttentionBatch
from dovetail.engine.request import Request
from dovetail.engine.scheduler import ScheduledBatch
from dovetail.forward_context import set_forward_context
from dovetail.layers.attention import Attention
from dovetail.platform import Platform

KV_CACHE_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}


@dataclass
class StepLogits:
    """Logits of one step: the sampling rows, and per request its prompt-logprob rows."""

    sample_logits: torch.Tensor | None
    sample_requests: list[Request]
    # request -> (logits for prompt positions, the prompt positions they predict)
    prompt_logits: dict[str, tuple[torch.Tensor, list[int]]]


class ModelRunner:
    """Prepares inputs, runs the model and returns the logits that will be sampled."""

    def __init__(self, model, platform: Platform, backend: type[AttentionBackend], block_size: int,
                 dtype: torch.dtype, kv_cache_dtype: str, device: torch.device):
        self.model = model
        self.platform = platform
        self.backend = backend
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.kv_dtype = dtype if kv_cache_dtype == "auto" else KV_CACHE_DTYPES[kv_cache_dtype]
        self.attention_layers: list[Attention] = sorted(
            (m for m in model.modules() if isinstance(m, Attention)), key=lambda m: m.layer_index)
        self.metadata_builder = backend.metadata_builder_cls()(
            backend, [layer.spec for layer in self.attention_layers], block_size, device, dtype)
        self.kv_caches: list[torch.Tensor] = []

    # -- KV cache ------------------------------------------------------------------------

    def bytes_per_block(self) -> int:
        element = torch.tensor([], dtype=self.kv_dtype).element_size()
        total = 0
        for layer in self.attention_layers:
            shape = self.backend.kv_cache_shape(1, self.block_size, layer.spec.num_kv_heads, layer.spec.head_size)
            total += element * int(torch.Size(shape).numel())
        return total

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = []
        for layer in self.attention_layers:
            shape = self.backend.kv_cache_shape(num_blocks, self.block_size, layer.spec.num_kv_heads,
                                                layer.spec.head_size)
            cache = torch.empty(shape, dtype=self.kv_dtype, device=self.device)
            layer.kv_cache = cache
            self.kv_caches.append(cache)

    # -- inputs ------------------------------------------------------------------------------

    def prepare(self, batch: ScheduledBatch, block_tables: list[list[int]]):
        """Flatten the batch into input ids, positions and the attention batch."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, seq_lens = [], []
        for req, n, table in zip(batch.requests, batch.num_new_tokens, block_tables):
            start = req.num_computed_tokens
            end = start + n
            input_ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(n)
            seq_lens.append(end)
        attn = AttentionBatch.build(query_lens, seq_lens, block_tables, slots, bs, self.device)
        dev = self.device
        return (torch.tensor(input_ids, dtype=torch.long).to(dev, non_blocking=True),
                torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True), attn)

    # -- the step ------------------------------------------------------------------------

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        metadata = self.metadata_builder.build(attn)
        with set_forward_context(metadata):
            return self.model(input_ids, positions)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, block_tables: list[list[int]]) -> StepLogits:
        input_ids, positions, attn = self.prepare(batch, block_tables)
        hidden = self.run_model(input_ids, positions, attn)
        sample_rows, sample_requests = [], []
        prompt_rows: dict[str, tuple[list[int], list[int]]] = {}
        offset = 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start = req.num_computed_tokens
            if start + n == req.num_tokens:
                sample_rows.append(offset + n - 1)
                sample_requests.append(req)
            if req.params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                last = min(start + n, req.num_prompt_tokens - 1)
                rows = list(range(offset, offset + last - start))
                prompt_rows[req.request_id] = (rows, list(range(start + 1, last + 1)))
            offset += n
        sample_logits = None
        if sample_rows:
            index = torch.tensor(sample_rows, device=hidden.device)
            sample_logits = self.model.compute_logits(hidden.index_select(0, index))
        prompt_logits = {}
        for request_id, (rows, predicted) in prompt_rows.items():
            index = torch.tensor(rows, device=hidden.device)
            prompt_logits[request_id] = (self.model.compute_logits(hidden.index_select(0, index)), predicted)
        return StepLogits(sample_logits, sample_requests, prompt_logits)

    # -- profiling ---------------------------------------------------------------------------

    @torch.inference_mode()
    def profile(self, max_tokens: int, max_seqs: int, max_model_len: int) -> int:
        """Run the largest batch once with a scratch cache; return the peak bytes used."""
        num_seqs = max(1, min(max_seqs, max_tokens))
        per_seq = min(max_model_len, max(1, max_tokens // num_seqs))
        num_seqs = min(num_seqs, max(1, max_tokens // per_seq))
        blocks_per_seq = -(-per_seq // self.block_size)
        self.allocate_kv_cache(num_seqs * blocks_per_seq)
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_seqs)]
        slots = [t[p // self.block_size] * self.block_size + p % self.block_size
                 for t in tables for p in range(per_seq)]
        attn = AttentionBatch.build([per_seq] * num_seqs, [per_seq] * num_seqs, tables, slots,
                                self.block_size, self.device)
        tokens = num_seqs * per_seq
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
        pos = torch.arange(per_seq, device=self.device).repeat(num_seqs)
        self.platform.synchronize()
        self.platform.reset_peak_memory_stats()
        hidden = self.run_model(ids, pos, attn)
        last = torch.arange(num_seqs, device=self.device) * per_seq + per_seq - 1
        logits = self.model.compute_logits(hidden.index_select(0, last.repeat(-(-max_seqs // num_seqs))[:max_seqs]))
        torch.softmax(logits.float(), dim=-1)
        self.platform.synchronize()
        peak = self.platform.memory_stats().get("peak_allocated", 0)
        del hidden, logits
        self.kv_caches = []
        for layer in self.attention_layers:
            layer.kv_cache = torch.empty(0)
        self.platform.empty_cache()
        return peak

