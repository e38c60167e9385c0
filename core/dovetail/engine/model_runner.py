"""Runs the model once per step over the flattened mixed prefill/decode batch.

It owns the KV caches (one tensor per attention layer, shaped by the backend,
plus one spare block that padding rows write to), builds the step's
:class:`AttentionBatch` and the backend's metadata, runs the forward, and
computes logits only for the rows where a token is sampled (plus the prompt rows
of requests that asked for prompt logprobs). Under tensor parallelism the sampled
rows' logits stay split by vocabulary (:class:`ShardedLogits`) where the model
allows: greedy steps never gather them.

Decode-only steps replay a device graph when the platform and the backend can
capture one (:class:`DecodeGraphs`); ``enforce_eager`` turns that off. A pooling
model's runner computes no logits: its :class:`~dovetail.engine.pooler.Pooler`
pools the hidden states of the prompts each step completes. Nothing
here waits for the device: inputs go over with non-blocking copies, and the
sampler's token transfer is the step's one synchronisation.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from dovetail.attention.backend import AttentionBackend
from dovetail.attention.batch import AttentionBatch
from dovetail.device_copy import copy_to_device, to_device, values_to_device
from dovetail.distributed import backend_collectives, tp_rank
from dovetail.engine.micro_batches import parts_share_blocks, run_interleaved, split_point
from dovetail.engine.pooler import Pooler
from dovetail.engine.scheduler import ScheduledBatch
from dovetail.engine.sharded_logits import ShardedLogits
from dovetail.engine.speculative import sampling_positions
from dovetail.forward_context import set_forward_context
from dovetail.layers.attention import Attention
from dovetail.lora.context import lora_slots, slot_mask_of
from dovetail.platform import DeviceGraph, Platform

if TYPE_CHECKING:
    from dovetail.engine.request_state import RequestState

logger = logging.getLogger("dovetail")

KV_CACHE_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}

#: Largest decode batch captured in a graph by default; bigger decode steps run eagerly.
MAX_GRAPH_BATCH = 512
#: Largest batch of speculative decoding's steps captured in a graph (drafts pay at small batches).
MAX_VERIFY_GRAPH_BATCH = 64


def graph_batch_sizes(max_num_seqs: int, capture_sizes: list[int] | None = None,
                      max_capture_size: int | None = None) -> list[int]:
    """Decode batch sizes to capture, ascending; a step pads up to the next, and a larger one runs eagerly.

    The default is vLLM's: 1, 2, 4, every 8 below 256, then every 16, up to the largest batch
    (``max_num_seqs``, at most ``max_capture_size``, by default 512), which is always captured.
    ``capture_sizes`` replaces that list; sizes above the largest batch are dropped.
    """
    cap = min(max_num_seqs, max_capture_size or MAX_GRAPH_BATCH)
    if capture_sizes is not None:
        return sorted({s for s in capture_sizes if s <= cap})
    candidates = [1, 2, 4, *range(8, 256, 8), *range(256, cap + 1, 16)]
    sizes = [s for s in candidates if s <= cap]
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


@dataclass
class StepLogits:
    """Logits of one step: the sampling rows, and per request its prompt-logprob rows. A speculative row's
    sequence is followed in ``sample_requests`` by one :class:`~dovetail.engine.speculative.DraftPosition` per
    draft."""

    sample_logits: torch.Tensor | ShardedLogits | None
    sample_requests: list[RequestState]
    # request -> (logits for prompt positions, the prompt positions they predict)
    prompt_logits: dict[str, tuple[torch.Tensor, list[int]]]
    #: A pooling runner's answer instead of logits: the requests whose prompt the step completed, and their
    #: pooled hidden states.
    pooled: tuple[list[RequestState], torch.Tensor | None] | None = None


def pending_inputs(batch: ScheduledBatch) -> tuple[list[int], list[int]]:
    """(input rows, rows of the in-flight step's tokens) of the sequences whose last input token is
    still on the device."""
    dst, src, offset = [], [], 0
    for req, n in zip(batch.requests, batch.num_new_tokens):
        offset += n
        if req.num_computed_tokens + n > len(req.all_token_ids) + len(req.draft_token_ids):
            dst.append(offset - 1)
            src.append(req.pending_row)
    return dst, src


def input_tokens(req, start: int, count: int) -> list[int]:
    """The ``count`` input tokens of a sequence from position ``start``: its known tokens, then its draft tokens
    (speculative decoding), or a 0 where its last token is still on the device (:func:`pending_inputs`)."""
    known = req.all_token_ids
    if start + count <= len(known):
        return known[start:start + count]
    if req.draft_token_ids:
        return [*known[start:], *req.draft_token_ids][:count]
    return [*known[start:], 0]


def fill_pending(input_ids: torch.Tensor, rows: tuple[list[int], list[int]], prev_tokens: torch.Tensor | None):
    """Copy the in-flight step's sampled tokens into ``input_ids`` on the device, without the host."""
    dst, src = rows
    if dst:
        device = input_ids.device
        place_pending(input_ids, values_to_device(dst, torch.long, device), values_to_device(src, torch.long, device),
                      prev_tokens)


def place_pending(input_ids: torch.Tensor, index: torch.Tensor | None, source: torch.Tensor,
                  prev_tokens: torch.Tensor | None) -> None:
    """Rows ``index`` of ``input_ids`` take rows ``source`` of the in-flight step's tokens ``prev_tokens``
    (device index tensors); ``index`` None: its first ``len(source)`` rows, in one gather."""
    if prev_tokens is None:
        raise RuntimeError("a sequence waits for a token of a step that is not in flight")
    if index is None:
        torch.index_select(prev_tokens, 0, source, out=input_ids[:source.numel()])
    else:
        input_ids.index_copy_(0, index, prev_tokens.index_select(0, source))


def block_table_array(block_tables: list[list[int]], rows: int | None = None, fill: int = 0) -> np.ndarray:
    """``[rows, widest table]`` int32 on the host, each table left-aligned and padded with ``fill``."""
    rows = len(block_tables) if rows is None else rows
    lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    width = max(int(lens.max()) if len(block_tables) else 0, 1)
    table = np.full((rows, width), fill, dtype=np.int32)
    total = int(lens.sum())
    if total:  # a boolean mask selects row by row, left to right: the order of the concatenated tables
        flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32, count=total)
        table[:len(block_tables)][np.arange(width) < lens[:, None]] = flat
    return table


def block_table_tensor(block_tables: list[list[int]], rows: int | None = None, fill: int = 0) -> torch.Tensor:
    """:func:`block_table_array` as a torch tensor."""
    return torch.from_numpy(block_table_array(block_tables, rows, fill))


class ModelRunner:
    """Prepares inputs, runs the model and returns the logits that will be sampled."""

    def __init__(self, model, platform: Platform, backend: type[AttentionBackend], block_size: int,
                 dtype: torch.dtype, kv_cache_dtype: str, device: torch.device, *, max_num_seqs: int = 256,
                 max_model_len: int | None = None, enforce_eager: bool = False,
                 cudagraph_capture_sizes: list[int] | None = None, max_cudagraph_capture_size: int | None = None,
                 micro_batch_tokens: int | None = None, pooler: Pooler | None = None, lora_slots: int = 0,
                 speculative_tokens: int = 0):
        self.model = model
        #: Speculative decoding's drafts a step (0: none), whose steps get graphs of their own.
        self.speculative_tokens = speculative_tokens
        #: LoRA slots of the model's layers (0: no LoRA): each step tells them each token's slot.
        self.lora_slots = lora_slots
        #: Set for a pooling model: steps return pooled hidden states, never logits, and run no graphs.
        self.pooler = pooler
        #: The LM head whose vocabulary shards greedy steps sample from (None: whole logits).
        self.sharded_head = model.sharded_lm_head()
        self.platform = platform
        self.backend = backend
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.kv_dtype = dtype if kv_cache_dtype == "auto" else KV_CACHE_DTYPES[kv_cache_dtype]
        self.attention_layers: list[Attention] = sorted(
            (m for m in model.modules() if isinstance(m, Attention)), key=lambda m: m.layer_index)
        if self.kv_dtype.itemsize == 1:
            calibrated = sum(1 for m in self.attention_layers if (m.impl.k_scale, m.impl.v_scale) != (1.0, 1.0))
            logger.info("KV cache in %s: %d of %d layers with the checkpoint's scales, the others 1.0 (as vLLM; "
                        "uncalibrated scales may cost accuracy)", kv_cache_dtype, calibrated,
                        len(self.attention_layers))
        self.metadata_builder = backend.metadata_builder_cls()(
            backend, [layer.spec for layer in self.attention_layers], block_size, device, dtype)
        self.kv_caches: list[torch.Tensor] = []
        self.spare_block = 0
        self.use_graphs = (not enforce_eager and pooler is None and platform.supports_graph_capture
                           and backend.supports_graph_capture and max_model_len is not None)
        self.graph_sizes = graph_batch_sizes(max_num_seqs, cudagraph_capture_sizes, max_cudagraph_capture_size)
        self.graphs: DecodeGraphs | None = None
        #: Speculative decoding's steps (every sequence with ``speculative_tokens`` drafts), where captured.
        self.verify_graphs: DecodeGraphs | None = None
        #: Steps of at least this many tokens run as two overlapped micro-batches (None: every step whole).
        self.micro_batch_tokens = self._micro_batch_tokens(micro_batch_tokens)
        self._side_stream = (torch.Stream(device=device) if self.micro_batch_tokens and platform.is_accelerator
                             else None)
        self.micro_batched_steps = 0

    def _micro_batch_tokens(self, tokens: int | None) -> int | None:
        if tokens is None:
            return None
        reason = None
        if getattr(self.model, "forward_steps", None) is None:
            reason = f"{type(self.model).__name__} has no forward_steps"
        elif not self.metadata_builder.independent_builds:
            reason = f"the {self.backend.name} attention backend plans one step at a time"
        elif self.lora_slots:
            reason = "LoRA adapters are enabled"
        if reason is not None:
            logger.info("dual-batch overlap off: %s", reason)
            return None
        if tp_rank() == 0:
            logger.info("dual-batch overlap: steps of %d tokens or more run as two micro-batches", tokens)
        return tokens

    # -- KV cache ------------------------------------------------------------------------

    def bytes_per_block(self) -> int:
        element = torch.tensor([], dtype=self.kv_dtype).element_size()
        total = 0
        for layer in self.attention_layers:
            shape = self.backend.kv_cache_shape(1, self.block_size, layer.spec.num_kv_heads, layer.spec.head_size)
            total += element * int(torch.Size(shape).numel())
        return total

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` usable blocks per layer, plus a spare one (number ``num_blocks``)
        that no sequence owns: padding rows of graph batches write there."""
        self.kv_caches = []
        self.spare_block = num_blocks
        for layer in self.attention_layers:
            shape = self.backend.kv_cache_shape(num_blocks + 1, self.block_size, layer.spec.num_kv_heads,
                                                layer.spec.head_size)
            cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            layer.kv_cache = cache
            self.kv_caches.append(cache)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture the decode graphs (after the KV cache is allocated); a no-op when graphs are off."""
        if self.use_graphs and self.kv_caches and self.graph_sizes:
            try:
                self.graphs = DecodeGraphs(self, self.graph_sizes)
            except NotImplementedError as exc:
                logger.warning("decode steps run eagerly: %s (the platform declares supports_graph_capture)", exc)
                return
            verify_sizes = [s for s in self.graph_sizes if s <= MAX_VERIFY_GRAPH_BATCH]
            if self.speculative_tokens and self.backend.supports_uniform_query_graphs and verify_sizes:
                self.verify_graphs = DecodeGraphs(self, verify_sizes, self.speculative_tokens + 1)

    # -- inputs ------------------------------------------------------------------------------

    def prepare(self, batch: ScheduledBatch, block_tables: list[list[int]]):
        """Flatten the batch into input ids, positions and the attention batch.

        A sequence whose last input token is still on the device (sampled by the
        step in flight) gets a 0 there; :func:`pending_inputs` says where to put it.
        """
        bs = self.block_size
        starts = [req.num_computed_tokens for req in batch.requests]
        query_lens = list(batch.num_new_tokens)
        input_ids = list(itertools.chain.from_iterable(
            map(input_tokens, batch.requests, starts, query_lens)))
        q_lens = torch.tensor(query_lens, dtype=torch.long)
        seq_lens = torch.tensor(starts, dtype=torch.long) + q_lens
        qsl = torch.zeros(len(query_lens) + 1, dtype=torch.long)
        torch.cumsum(q_lens, 0, out=qsl[1:])
        num_tokens = int(qsl[-1])
        row_of = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)
        positions = torch.arange(num_tokens) - qsl[:-1][row_of] + (seq_lens - q_lens)[row_of]
        table = block_table_tensor(block_tables)
        slots = table[row_of, positions // bs].long() * bs + positions % bs
        num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
        dev = self.device
        qsl32, seq32 = qsl.int(), seq_lens.int()
        attn = AttentionBatch(
            num_tokens=num_tokens, num_seqs=len(query_lens), num_decodes=num_decodes,
            max_query_len=max(query_lens, default=0), max_seq_len=int(seq_lens.max()) if len(query_lens) else 0,
            query_start_loc=to_device(qsl32, dev), seq_lens=to_device(seq32, dev),
            block_table=to_device(table, dev), slot_mapping=to_device(slots, dev), query_start_loc_cpu=qsl32,
            seq_lens_cpu=seq32, block_size=bs, block_table_cpu=table)
        return values_to_device(input_ids, torch.long, dev), to_device(positions, dev), attn

    # -- the step ------------------------------------------------------------------------

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch,
                  lora_mask: torch.Tensor | None = None) -> torch.Tensor:
        metadata = self.metadata_builder.build(attn)
        with set_forward_context(metadata), lora_slots(lora_mask):
            return self.model(input_ids, positions)

    def lora_mask(self, slots: list[int], repeats: list[int] | None = None) -> torch.Tensor | None:
        """The one-hot LoRA slot mask of the rows of requests in ``slots`` (-1: none), each repeated ``repeats``
        times (None: once); None without LoRA."""
        if not self.lora_slots:
            return None
        per_row = np.repeat(np.asarray(slots, dtype=np.int64), repeats if repeats is not None else 1)
        return slot_mask_of(to_device(torch.from_numpy(per_row), self.device), self.lora_slots, self.dtype)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, block_tables: list[list[int]],
                prev_tokens: torch.Tensor | None = None) -> StepLogits:
        """Run one step; ``prev_tokens`` are the device tokens of the step in flight, which the
        sequences with a pending last token read their input from."""
        if self.graphs is not None and self.graphs.can_run(batch):
            return StepLogits(self.graphs.run(batch, block_tables, prev_tokens), list(batch.requests), {})
        if self.verify_graphs is not None and self.verify_graphs.can_run(batch):
            return StepLogits(self.verify_graphs.run(batch, block_tables, prev_tokens),
                              [row for req in batch.requests for row in sampling_positions(req)], {})
        split = self._micro_batch_split(batch, block_tables)
        if split is None:
            input_ids, positions, attn = self.prepare(batch, block_tables)
            fill_pending(input_ids, pending_inputs(batch), prev_tokens)
            mask = self.lora_mask([r.lora_slot for r in batch.requests], batch.num_new_tokens)
            hidden = self.run_model(input_ids, positions, attn, mask)
        else:
            hidden = self.run_micro_batches(batch, block_tables, prev_tokens, split)
        if self.pooler is not None:
            return StepLogits(None, [], {}, pooled=self.pooler.pool(batch, hidden))
        sample_rows, sample_requests = [], []
        prompt_rows: dict[str, tuple[list[int], list[int]]] = {}
        offset = 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start = req.num_computed_tokens
            drafts = len(req.draft_token_ids)
            if start + n == req.num_tokens + drafts:
                if drafts:  # a speculative row samples at its last token and at each draft
                    sample_rows.extend(range(offset + n - 1 - drafts, offset + n))
                    sample_requests.extend(sampling_positions(req))
                else:
                    sample_rows.append(offset + n - 1)
                    sample_requests.append(req)
            if req.params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                last = min(start + n, req.num_prompt_tokens - 1)
                rows = list(range(offset, offset + last - start))
                prompt_rows[req.request_id] = (rows, list(range(start + 1, last + 1)))
            offset += n
        sample_logits = None
        if sample_rows:
            sample_logits = self.sample_logits(self._rows(hidden, sample_rows))
        prompt_logits = {}
        for request_id, (rows, predicted) in prompt_rows.items():
            prompt_logits[request_id] = (self.model.compute_logits(self._rows(hidden, rows)), predicted)
        return StepLogits(sample_logits, sample_requests, prompt_logits)

    def _micro_batch_split(self, batch: ScheduledBatch, block_tables: list[list[int]]) -> int | None:
        """Where this step splits into two micro-batches; None: it runs whole."""
        if not self.micro_batch_tokens:
            return None
        split = split_point(batch.num_new_tokens, self.micro_batch_tokens)
        if split is not None and parts_share_blocks([r.num_computed_tokens for r in batch.requests],
                                                    batch.num_new_tokens, block_tables, self.block_size, split):
            return None
        return split

    def run_micro_batches(self, batch: ScheduledBatch, block_tables: list[list[int]], prev_tokens: torch.Tensor | None,
                          split: int) -> torch.Tensor:
        """The hidden states of ``batch`` computed as two micro-batches, its requests before ``split`` and from
        it on, overlapped (:mod:`dovetail.engine.micro_batches`)."""
        parts = []
        for rows in (slice(0, split), slice(split, None)):
            part = ScheduledBatch(batch.requests[rows], batch.num_new_tokens[rows])
            input_ids, positions, attn = self.prepare(part, block_tables[rows])
            fill_pending(input_ids, pending_inputs(part), prev_tokens)
            parts.append((input_ids, positions, self.metadata_builder.build(attn)))
        with backend_collectives(), self.platform.micro_batches_context():
            hidden = run_interleaved(self.model.forward_steps, parts, self._side_stream)
        self.micro_batched_steps += 1
        return torch.cat(hidden)

    def sample_logits(self, hidden: torch.Tensor) -> torch.Tensor | ShardedLogits:
        """The logits of the rows a token is sampled from: whole, or this rank's vocabulary shard of them."""
        if self.sharded_head is None:
            return self.model.compute_logits(hidden)
        return ShardedLogits(self.sharded_head, self.sharded_head(hidden, gather=False))

    def _rows(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return hidden[rows[0]:rows[0] + len(rows)]
        return hidden.index_select(0, values_to_device(rows, torch.long, hidden.device))

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
        hidden = self.run_model(ids, pos, attn, self.lora_mask([-1] * tokens))
        if self.pooler is None:  # a pooling model computes no logits
            last = torch.arange(num_seqs, device=self.device) * per_seq + per_seq - 1
            logits = self.model.compute_logits(
                hidden.index_select(0, last.repeat(-(-max_seqs // num_seqs))[:max_seqs]))
            torch.softmax(logits.float(), dim=-1)
            del logits
        self.platform.synchronize()
        peak = self.platform.memory_stats().get("peak_allocated", 0)
        del hidden
        self.kv_caches = []
        for layer in self.attention_layers:
            layer.kv_cache = torch.empty(0)
        self.platform.empty_cache()
        return peak


class DecodeGraphs:
    """Decode-only steps replayed from device graphs, one per padded batch size.

    The graphs read static buffers (token ids, positions, slots, sequence
    lengths, block table) and write the logits into one static buffer; a step
    writes its values into the inputs, pads the batch up to the nearest
    captured size with length-1 sequences that write to the spare block, lets
    the backend re-plan (``build_for_graph``) and replays. With a sharded LM
    head the buffer holds this rank's vocabulary columns, and the graph also
    writes the greedy tokens (a small gather in place of the logits').

    With ``tokens_per_seq`` above 1 the graphs replay speculative decoding's steps instead: every sequence
    computes its last token and ``tokens_per_seq - 1`` drafts, and every row's logits come out (sequence by
    sequence), for a backend that ``supports_uniform_query_graphs``.
    """

    def __init__(self, runner: ModelRunner, sizes: list[int], tokens_per_seq: int = 1):
        self.runner = runner
        self.sizes = sizes
        self.q = q = tokens_per_seq
        dev, n_max = runner.device, sizes[-1]
        self.width = -(-runner.max_model_len // runner.block_size)
        # One copy a step brings a size's token ids, positions and slots (contiguous, each size its own view),
        # the rows of the step in flight whose tokens are the inputs still pending, and the block tables; the
        # graph derives the lengths. Each host-to-device copy or small kernel between two graphs costs the
        # device several microseconds of idle, so the step's inputs take as few as they can.
        self.staging = torch.zeros(n_max * (3 * q + 2) + -(-n_max * self.width // 2), dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(n_max, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n_max + 1, dtype=torch.int32, device=dev) * q
        self.block_table = torch.full((n_max, self.width), runner.spare_block, dtype=torch.int32, device=dev)
        self.views: dict[int, dict] = {}  # per size: the static buffers' slices an AttentionBatch holds
        self.graphs: dict[int, DeviceGraph] = {}
        self.logits: torch.Tensor | None = None  # every graph's output: the logits of its rows
        self.head = runner.sharded_head
        self.greedy = torch.zeros(n_max * q, dtype=torch.long, device=dev) if self.head is not None else None
        #: Each row's one-hot LoRA slot (rows of no adapter and padding rows: all 0), with LoRA.
        self.lora_mask = (torch.zeros((n_max * q, runner.lora_slots), dtype=runner.dtype, device=dev)
                          if runner.lora_slots else None)
        pool = runner.platform.graph_pool()
        for size in reversed(sizes):  # largest first: the smaller graphs reuse its memory
            metadata = runner.metadata_builder.build_for_graph(self._load([], [], size), size)

            input_ids, positions, _ = self._inputs(size)

            def logits_of(size=size, metadata=metadata, input_ids=input_ids, positions=positions):
                torch.add(positions.view(size, q)[:, -1], 1, out=self.seq_lens[:size])
                mask = self.lora_mask[:size * q] if self.lora_mask is not None else None
                with set_forward_context(metadata), lora_slots(mask):
                    return runner.sample_logits(runner.model(input_ids, positions))

            warm = logits_of()  # warm-up: lazy initialisation and autotuning happen outside the capture
            if self.head is not None:
                warm.greedy_tokens()
                warm = warm.local
            if self.logits is None:
                self.logits = torch.empty((n_max * q, warm.shape[1]), dtype=warm.dtype, device=dev)
            del warm

            def forward(size=size, logits_of=logits_of):
                logits = logits_of()
                if self.head is not None:
                    self.greedy[:size * q].copy_(logits.greedy_tokens())
                    logits = logits.local
                self.logits[:size * q].copy_(logits)

            self.graphs[size], _ = runner.platform.capture_graph(forward, pool)
        runner.platform.synchronize()
        logger.info("captured %s graphs for batch sizes %s", "decode" if q == 1 else f"{q}-token verification",
                    ", ".join(map(str, sizes)))

    def can_run(self, batch: ScheduledBatch) -> bool:
        """Whether every sequence computes exactly its last token (and ``tokens_per_seq - 1`` drafts) and the
        batch fits a graph."""
        if len(batch.requests) > self.sizes[-1]:
            return False
        if self.q == 1:
            return all(n == 1 and req.num_computed_tokens + 1 == req.num_tokens
                       for req, n in zip(batch.requests, batch.num_new_tokens))
        drafts = self.q - 1
        return all(n == self.q and len(req.draft_token_ids) == drafts and req.num_computed_tokens + 1 == req.num_tokens
                   for req, n in zip(batch.requests, batch.num_new_tokens))

    def run(self, batch: ScheduledBatch, block_tables: list[list[int]],
            prev_tokens: torch.Tensor | None = None) -> torch.Tensor | ShardedLogits:
        """The logits ``[len(batch.requests) * tokens_per_seq, vocab]`` of the step (with a sharded LM head, this
        rank's columns of them and the greedy tokens)."""
        n, q = len(batch.requests), self.q
        size = next(s for s in self.sizes if s >= n)
        attn = self._load(batch.requests, block_tables, size, pending_inputs(batch), prev_tokens)
        if self.lora_mask is not None:
            slots = [r.lora_slot for r in batch.requests] + [-1] * (size - n)
            self.lora_mask[:size * q].copy_(self.runner.lora_mask(slots, None if q == 1 else [q] * size))
        self.runner.metadata_builder.build_for_graph(attn, size)
        self.graphs[size].replay()
        if self.head is not None:
            return ShardedLogits(self.head, self.logits[:n * q], self.greedy[:n * q])
        return self.logits[:n * q]

    def _inputs(self, size: int) -> torch.Tensor:
        """The token ids, positions and slots ``[3, size * tokens_per_seq]`` that the graph of ``size`` reads."""
        return self.staging[:3 * size * self.q].view(3, size * self.q)

    def _load(self, requests: list[RequestState], block_tables: list[list[int]], size: int,
              pending: tuple[list[int], list[int]] = ([], []), prev_tokens: torch.Tensor | None = None,
              ) -> AttentionBatch:
        """Write a decode batch padded to ``size`` into the static buffers, with the tokens still pending read
        from ``prev_tokens`` (:func:`place_pending`); return its attention batch."""
        runner, bs, spare, q = self.runner, self.runner.block_size, self.runner.spare_block, self.q
        n, width = len(requests), size * q
        dst, src = pending
        every_row = dst == list(range(n))  # the usual decode step: every input is the step in flight's token
        table = block_table_array(list(block_tables) + [[spare]] * (size - n), fill=spare)
        rows = 3 * width + len(src) + (0 if every_row else len(dst))  # then the block tables, two to a row
        staged = np.zeros(rows + -(-table.size // 2), dtype=np.int64)
        ids, positions, slots = staged[:3 * width].reshape(3, width)
        if q == 1:
            positions[:n] = [req.num_computed_tokens for req in requests]
            ids[:n] = [req.all_token_ids[req.num_computed_tokens] if req.num_computed_tokens < len(req.all_token_ids)
                       else 0 for req in requests]
        else:  # each sequence's last token and drafts; a padding sequence's q tokens from position 0
            positions[:] = np.tile(np.arange(q), size)
            positions[:n * q] += np.repeat(np.fromiter((req.num_computed_tokens for req in requests), np.int64, n), q)
            ids[:n * q] = list(itertools.chain.from_iterable(
                input_tokens(req, req.num_computed_tokens, q) for req in requests))
        columns = positions // bs
        columns[n * q:] = 0  # a padding sequence's tokens all go to the spare block
        slots[:] = table[np.repeat(np.arange(size), q), columns].astype(np.int64) * bs + positions % bs
        staged[3 * width:rows] = src if every_row else src + dst
        staged.view(np.int32)[2 * rows:2 * rows + table.size] = table.ravel()
        seq_lens = torch.from_numpy((positions.reshape(size, q)[:, -1] + 1).astype(np.int32))
        table = torch.from_numpy(table)
        copy_to_device(self.staging[:len(staged)], torch.from_numpy(staged))
        if dst:
            place_pending(self._inputs(size)[0], None if every_row else self.staging[3 * width + len(src):rows],
                          self.staging[3 * width:3 * width + len(src)], prev_tokens)
        tables = self.staging.view(torch.int32)[2 * rows:2 * rows + table.numel()]
        self.block_table[:size, :table.shape[1]].copy_(tables.view(table.shape))
        if size not in self.views:
            self.views[size] = dict(query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
                                    block_table=self.block_table[:size], slot_mapping=self._inputs(size)[2],
                                    query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32) * q)
        return AttentionBatch(num_tokens=width, num_seqs=size, num_decodes=size if q == 1 else 0, max_query_len=q,
                              max_seq_len=runner.max_model_len, seq_lens_cpu=seq_lens, block_size=bs,
                              block_table_cpu=table, **self.views[size])
