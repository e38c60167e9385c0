"""A Worker owns one device: its model shard, KV cache, model runner, graphs and sampling state.

The engine (requests, scheduler, detokeniser, outputs) drives one worker per
rank through an executor (:mod:`dovetail.executor`). A worker joins the
tensor-parallel group before it builds the model, so the model's layers read
their rank and the group's size as they are built. It keeps a mirror of every
request it runs (:class:`RequestState`): the tokens it knows, the sampling
parameters, and the tokens it sampled whose values the engine has not applied
yet. Every rank samples from identical logits with identical state, so every
rank knows the same tokens; the driver (rank 0) reports them to the engine.
"""

from __future__ import annotations

import collections
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch

from dovetail import distributed, model_loader, pooling, selection
from dovetail.attention.backend import AttentionRequirements
from dovetail.config import EngineConfig
from dovetail.engine import frozen_heap
from dovetail.engine.laps import Laps
from dovetail.engine.model_runner import ModelRunner
from dovetail.engine.pooler import Pooler
from dovetail.engine.process_counters import process_counters
from dovetail.engine.profiler import StepProfiler
from dovetail.engine.request_state import RequestState
from dovetail.engine.sampler import PendingSample, launch_sample, prompt_logprobs
from dovetail.engine.scheduler import ScheduledBatch
from dovetail.engine.speculative import DraftPosition, accepted_tokens
from dovetail.engine.step_timeline import StepTimeline
from dovetail.engine.sharded_logits import ShardedLogits
from dovetail.engine.step import EMPTY_OUTPUT, StepDescription, StepOutput, apply_token_bitmask
from dovetail.errors import ConfigError
from dovetail.lora.model_lora import ModelLoRA
from dovetail.lora.request import LoRARequest
from dovetail.model_interface import ModelContext
from dovetail.plugin_manager import get_plugin_manager
from dovetail.platform import ALLOCATOR_COUNTS, HostCopy, Platform

logger = logging.getLogger("dovetail")


@dataclass
class WorkerSpec:
    """What every worker needs to build its part of the engine (picklable).

    ``config`` is the engine's, with the platform, attention backend and
    scheduler limits already resolved, so every rank chooses the same.
    """

    config: EngineConfig
    model_path: str
    dtype: torch.dtype
    max_model_len: int


def attention_requirements(spec: WorkerSpec, platform: Platform, shape) -> AttentionRequirements:
    """What an attention backend must support for this model on one rank (heads divided among the ranks)."""
    tp = spec.config.parallel.tensor_parallel_size
    cache = spec.config.cache
    return AttentionRequirements(
        platform=platform.name, device_type=platform.device_type, dtype=spec.dtype,
        kv_cache_dtype=cache.kv_cache_dtype, block_size=cache.block_size, head_size=shape.head_size,
        num_heads=max(1, shape.num_heads // tp), num_kv_heads=max(1, shape.num_kv_heads // tp),
        uses_sliding_window=shape.uses_sliding_window, uses_logit_softcap=shape.uses_logit_softcap)


def check_heads_divide(shape, world_size: int) -> None:
    """Refuse a model whose attention heads cannot be divided among ``world_size`` ranks (KV heads may be
    fewer than the ranks, and are then replicated, when the ranks divide evenly among them)."""
    if world_size == 1:
        return
    if shape.num_heads % world_size:
        raise ConfigError(f"tensor_parallel_size: the model's {shape.num_heads} attention heads are not divisible "
                          f"by tensor_parallel_size={world_size}")
    kv = shape.num_kv_heads
    if (kv >= world_size and kv % world_size) or (kv < world_size and world_size % kv):
        raise ConfigError(f"tensor_parallel_size: the model's {kv} KV heads cannot be divided among "
                          f"tensor_parallel_size={world_size} ranks (nor replicated evenly)")


@dataclass
class _Launched:
    """A step whose sampling is queued on the device: its rows and its prompt logprobs."""

    sample: Optional[PendingSample]
    rows: list[RequestState]
    prompt_logprobs: dict
    #: A pooling step's pooled states of ``rows``, in host memory once the device gets there (driver rank).
    embeddings: Optional[HostCopy] = None
    #: Whether some rows are speculative (their sequences followed in ``rows`` by their draft positions).
    speculative: bool = False


def host_threads(platform: Platform, owns_process: bool, environ=os.environ) -> int | None:
    """How many threads torch's host pool gets in a rank's process: one for a rank with a process of its own
    on an accelerator, unless ``OMP_NUM_THREADS`` says otherwise; None leaves the count as it is.

    Such a rank's host work is one thread preparing inputs and launching kernels. A larger pool wakes for every
    host copy above torch's grain size (a decode step's block tables), and its idle threads then spin, taking
    cores from the other ranks and the engine while they launch. On the CPU the threads are the platform's to
    share out among the ranks.
    """
    if not owns_process or not platform.is_accelerator or environ.get("OMP_NUM_THREADS", "").strip():
        return None
    return 1


class Worker:
    """One rank: builds the model on its device, sizes and holds the KV cache, runs and samples each step.

    ``owns_process``: the rank runs in a process of its own (the ``mp`` and ``ray`` executors), whose heap is
    frozen out of the garbage collector's full passes once the rank is up (:mod:`dovetail.engine.frozen_heap`).
    """

    def __init__(self, spec: WorkerSpec, rank: int = 0, world_size: int = 1,
                 distributed_init_method: str | None = None, local_rank: int | None = None,
                 platform: Platform | None = None, startup_phases: dict[str, float] | None = None,
                 owns_process: bool = False):
        laps = Laps(startup_phases)
        self.spec, self.rank, self.world_size = spec, rank, world_size
        self.owns_process = owns_process
        config = spec.config
        manager = get_plugin_manager()
        if platform is None:
            platform = selection.create_platform(config.device.device, manager)
            platform.check_and_update_config(config)
        self.platform = platform
        threads = host_threads(platform, owns_process)
        if threads is not None and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self.local_rank = rank if local_rank is None else local_rank
        platform.set_device(self.local_rank)
        self.device = platform.device(self.local_rank)
        distributed.init_tensor_parallel(world_size, rank, platform.dist_backend, distributed_init_method or "",
                                         self.device)
        laps.mark("device_and_group_s")
        if world_size > 1:
            distributed.set_all_reduce_kernel(platform.all_reduce_kernel(distributed.tp_group(), self.device))
            laps.mark("all_reduce_setup_s")
        platform.seed_everything(config.model.seed)

        path = model_loader.resolve_model_path(spec.model_path)
        self.hf_config = model_loader.load_hf_config(path)
        self.is_pooling = config.model.runner == "pooling"
        self.model_choice = selection.select_model_class(
            pooling.candidate_architectures(getattr(self.hf_config, "architectures", None) or [],
                                            config.model.runner), manager)
        shape = self.model_choice.cls.attention_shape(self.hf_config)
        self.attention_backend = selection.select_attention_backend(
            platform, attention_requirements(spec, platform, shape), config.device.attention_backend, manager)
        self.quant_method = selection.select_quant_method(
            platform, spec.dtype, config.model.quantization, model_loader.quantization_config(self.hf_config),
            manager)
        self.ops = platform.fused_ops()
        laps.mark("model_config_s")
        self.model = self._build_model(path, laps)
        lora = config.lora
        #: The model's LoRA slots and adapters (None: LoRA is off).
        self.lora = (ModelLoRA(self.model, lora.max_loras, lora.max_lora_rank, spec.dtype, self.device)
                     if lora.enable_lora else None)
        self.vocab_size = int(self.hf_config.vocab_size)
        self.runner = ModelRunner(self.model, platform, self.attention_backend, config.cache.block_size,
                                  spec.dtype, config.cache.kv_cache_dtype, self.device,
                                  max_num_seqs=config.scheduler.max_num_seqs, max_model_len=spec.max_model_len,
                                  enforce_eager=config.device.enforce_eager,
                                  cudagraph_capture_sizes=config.device.cudagraph_capture_sizes,
                                  max_cudagraph_capture_size=config.device.max_cudagraph_capture_size,
                                  micro_batch_tokens=(config.parallel.dbo_prefill_token_threshold
                                                      if config.parallel.enable_dbo else None),
                                  pooler=(Pooler(config.model.pooler_config["pooling_type"]) if self.is_pooling
                                          else None),
                                  lora_slots=lora.max_loras if lora.enable_lora else 0,
                                  speculative_tokens=(config.speculative.speculative_config.num_speculative_tokens
                                                      if config.speculative.speculative_config is not None else 0))
        self.requests: dict[str, RequestState] = {}
        self._launched: collections.deque[_Launched] = collections.deque()
        self._last_tokens: torch.Tensor | None = None
        self._unsampled: torch.Tensor | None = None  # the logits of a step whose bitmask is still to come
        self.profiler = StepProfiler(rank, platform.device_type)
        self.timeline = StepTimeline()
        laps.mark("runner_s")
        #: Seconds of this rank's start-up: what its executor measured before (``startup_phases``: its process
        #: coming up, imports included, and waiting for its work), then the device and the process group, the
        #: all-reduce's setup (several ranks), the model's configuration and the selections, building the
        #: model, its weights (loaded or drawn, then processed), the model runner.
        self.startup_phases = laps.seconds

    def _build_model(self, path, laps: Laps):
        ctx = ModelContext(dtype=self.spec.dtype, device=self.device, quant=self.quant_method,
                           attention_backend=self.attention_backend, ops=self.ops,
                           quant_kernels=self.platform.quant_kernels())
        with torch.device(self.device):
            model = self.model_choice.cls(self.hf_config, "", ctx=ctx)
        laps.mark("model_build_s")
        if self.spec.config.model.load_format == "dummy":
            model_loader.fill_dummy_weights(model, self.spec.config.model.seed)
        else:
            if self.is_pooling:  # a pooling model needs no LM head, and may be a base model's checkpoint
                model_loader.load_weights(model, path, adapt=pooling.base_model_weights, optional=("lm_head.",))
            else:
                model_loader.load_weights(model, path)
        model_loader.process_weights_after_loading(model)
        if self.is_pooling:
            pooling.release_lm_head(model)
        laps.mark("weights_s")
        return model.eval()

    # -- the KV cache ------------------------------------------------------------------------

    def determine_num_blocks(self) -> int:
        """The KV-cache blocks this rank can hold (the engine takes the minimum over the ranks)."""
        import gc

        config, platform = self.spec.config, self.platform
        cache, sched = config.cache, config.scheduler
        per_block = self.runner.bytes_per_block()
        need_one = -(-self.spec.max_model_len // cache.block_size)
        if cache.num_gpu_blocks_override:
            num_blocks = cache.num_gpu_blocks_override
        elif platform.is_accelerator:
            gc.collect()  # an engine dropped earlier in this process must not count in the profile
            platform.empty_cache()
            budget = platform.kv_cache_bytes(config, lambda: self.runner.profile(
                sched.max_num_batched_tokens, sched.max_num_seqs, self.spec.max_model_len))
            num_blocks = budget // per_block
        else:
            budget = platform.kv_cache_bytes(config, lambda: 0) if cache.kv_cache_memory_bytes is None \
                else cache.kv_cache_memory_bytes
            num_blocks = budget // per_block
            if cache.kv_cache_memory_bytes is None:
                # No point zeroing more than every sequence at full length can use.
                num_blocks = min(num_blocks, need_one * sched.max_num_seqs + need_one)
        if num_blocks < need_one:
            raise ConfigError(
                f"the KV cache holds {num_blocks} blocks of {cache.block_size} tokens "
                f"({num_blocks * per_block} bytes) on rank {self.rank}, fewer than one sequence of "
                f"max_model_len={self.spec.max_model_len} needs ({need_one}); raise kv_cache_memory_bytes / "
                "gpu_memory_utilization or lower max_model_len")
        return int(num_blocks)

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks per layer and capture the decode graphs: the last of the rank's start-up."""
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.capture_graphs()
        if self.owns_process:
            frozen_heap.freeze_for_good()

    # -- the step -----------------------------------------------------------------------------

    def execute_model(self, step: StepDescription) -> None:
        """Update the request mirrors, run the model on the step and queue its sampling; nothing waits
        for the device. Rows whose last token is still on the device read it from the last step's tokens."""
        self.timeline.mark("execute")
        requests = self.requests
        for request_id in step.finished_request_ids:
            requests.pop(request_id, None)
        def adapters_in_use() -> set[int]:
            return {r.lora_id for r in requests.values()}

        for data in step.new_requests:
            state = requests[data.request_id] = RequestState(data)
            if state.lora_id:
                state.lora_slot = self.lora.activate(state.lora_id, adapters_in_use)
        for request_id, blocks in step.new_block_ids.items():
            requests[request_id].block_ids.extend(blocks)
        for request_id, drafts in step.draft_token_ids.items():
            requests[request_id].draft_token_ids = drafts
        states = [requests[r] for r in step.request_ids]
        batch = ScheduledBatch(states, step.num_new_tokens)
        logits = self.runner.execute(batch, [s.block_ids for s in states], self._last_tokens)
        for state, n in zip(states, step.num_new_tokens):
            state.num_computed_tokens += n
        prompt = {}
        if logits.prompt_logits and self.rank == 0:
            for request_id, (prompt_logits, predicted) in logits.prompt_logits.items():
                state = requests[request_id]
                targets = [state.prompt_token_ids[p] for p in predicted]
                prompt[request_id] = (predicted, prompt_logprobs(prompt_logits, targets,
                                                                 state.params.prompt_logprobs))
        if logits.pooled is not None:
            finished, embeddings = self._pooled_to_host(logits.pooled)
            self._launched.append(_Launched(None, finished, {}, embeddings))
            self._last_tokens = None
            return
        rows = logits.sample_requests
        self._launched.append(_Launched(None, rows, prompt, speculative=bool(step.draft_token_ids)))
        if rows and step.sample_later:
            self._unsampled = logits.sample_logits  # the bitmask follows (sample_with_bitmask)
            return
        self._sample(logits.sample_logits, step.token_bitmask, step.bitmask_rows)
        self.timeline.mark("launched")

    def sample_with_bitmask(self, token_bitmask: Optional[torch.Tensor], bitmask_rows: Optional[list[int]]) -> None:
        """Sample the step launched last with ``sample_later``, under ``token_bitmask`` (or none)."""
        logits, self._unsampled = self._unsampled, None
        if logits is None:
            raise RuntimeError("sample_with_bitmask: the last step was not launched with sample_later")
        self._sample(logits, token_bitmask, bitmask_rows)

    def _sample(self, sample_logits: Optional[torch.Tensor | ShardedLogits], token_bitmask: Optional[torch.Tensor],
                bitmask_rows: Optional[list[int]]) -> None:
        """Queue the sampling of the step launched last; its tokens feed the next step on the device."""
        launched = self._launched[-1]
        rows = launched.rows
        if rows:
            if token_bitmask is not None:
                with torch.inference_mode():  # the logits are the model's inference tensors
                    if isinstance(sample_logits, ShardedLogits):
                        sample_logits = sample_logits.gather()
                    apply_token_bitmask(sample_logits, token_bitmask, bitmask_rows, self.vocab_size)
            launched.sample = launch_sample(sample_logits, rows, self.vocab_size, self.ops.argmax)
            launched.sample.start_transfer(self.platform)
            for row, state in enumerate(rows):
                if not isinstance(state, DraftPosition):
                    state.num_pending += 1
                    state.pending_row = row
        self._last_tokens = launched.sample.tokens if launched.sample is not None else None

    def _pooled_to_host(self, pooled) -> tuple[list[RequestState], Optional[HostCopy]]:
        """The finished requests and their pooled states, on their way to the host (driver rank only)."""
        finished, vectors = pooled
        if vectors is None or self.rank != 0:
            return finished, None
        return finished, self.platform.copy_to_host_async(vectors)

    def take_output(self) -> StepOutput | None:
        """Wait for the oldest launched step's tokens, add them to the mirrors and return them
        (the driver rank returns them; the others return None)."""
        self.timeline.mark("take")
        launched = self._launched.popleft()
        if self.is_pooling:
            if self.rank != 0:
                return None
            embeddings = launched.embeddings.wait().numpy() if launched.embeddings is not None else None
            return StepOutput([], [], embeddings=embeddings)
        if launched.sample is None:
            output = EMPTY_OUTPUT if not launched.prompt_logprobs else StepOutput([], [], launched.prompt_logprobs)
            return output if self.rank == 0 else None
        result = launched.sample.result()
        self.timeline.mark("tokens")
        if launched.speculative:
            return self._take_speculative(launched, result)
        for state, token in zip(launched.rows, result.token_ids):
            state.num_pending -= 1
            state.output_token_ids.append(token)
            state.all_token_ids.append(token)
        if self.rank != 0:
            return None
        return StepOutput(result.token_ids, result.logprobs, launched.prompt_logprobs)

    def _take_speculative(self, launched: _Launched, result) -> StepOutput | None:
        """A step with speculative rows: each keeps the tokens :func:`accepted_tokens` gives it, and forgets the
        computed positions of its drafts that were not accepted; the first of its tokens is its row's token in
        the output, the rest go in ``draft_rows``."""
        token_ids, logprobs, draft_rows = [], [], {}
        i, rows = 0, launched.rows
        while i < len(rows):
            state = rows[i]
            drafts = state.draft_token_ids
            span = 1 + len(drafts)
            tokens = accepted_tokens(result.token_ids[i:i + span], drafts)
            infos = result.logprobs[i:i + len(tokens)]
            state.num_pending -= 1
            state.num_computed_tokens -= len(drafts) - (len(tokens) - 1)
            state.draft_token_ids = []
            state.output_token_ids.extend(tokens)
            state.all_token_ids.extend(tokens)
            if len(tokens) > 1:
                draft_rows[len(token_ids)] = list(zip(tokens[1:], infos[1:]))
            token_ids.append(tokens[0])
            logprobs.append(infos[0])
            i += span
        if self.rank != 0:
            return None
        return StepOutput(token_ids, logprobs, launched.prompt_logprobs, draft_rows=draft_rows)

    def execute_then_take(self, step: StepDescription) -> StepOutput | None:
        """:meth:`execute_model` on ``step``, then :meth:`take_output` (of the oldest step launched): the ``ray``
        executor sends a step with the call for the output of the one before, one Ray call a step."""
        self.execute_model(step)
        return self.take_output()

    def add_lora(self, request: LoRARequest) -> str | None:
        """Read an adapter for later requests; the reason it cannot run, else None."""
        if self.lora is None:
            return "lora_request: LoRA is not enabled (enable_lora=True, --enable-lora)"
        return self.lora.add(request)

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter that no request uses (its slot is reused when needed)."""
        if self.lora is not None:
            self.lora.remove(lora_int_id)

    def reset(self) -> None:
        """Forget every request and launched step (after a failed step, whose requests the engine aborts)."""
        self.requests.clear()
        self._launched.clear()
        self._last_tokens = None
        self._unsampled = None

    def verify_graph_sizes(self) -> list[int] | None:
        """The batch sizes whose speculative steps (every sequence with all its drafts) replay a graph, if any."""
        graphs = self.runner.verify_graphs
        return list(graphs.sizes) if graphs is not None else None

    def startup_report(self) -> dict[str, float]:
        """:attr:`startup_phases`, each to the hundredth of a second."""
        return {name: round(seconds, 2) for name, seconds in self.startup_phases.items()}

    def describe(self) -> dict:
        """This rank's device and how many its process sees, its all-reduce kernel, captured graph sizes, steps
        run as micro-batches, parameter shapes, whether its heap is frozen and its host threads (for logs and
        tests)."""
        graphs = self.runner.graphs
        return {"rank": self.rank, "world_size": self.world_size, "device": str(self.device),
                "visible_devices": self.platform.device_count(),
                "all_reduce": distributed.all_reduce_kernel_name(), "heap_frozen": frozen_heap.is_frozen(),
                "host_threads": torch.get_num_threads(),
                "graph_sizes": list(graphs.sizes) if graphs is not None else None,
                "micro_batched_steps": self.runner.micro_batched_steps,
                "parameters": {name: tuple(p.shape) for name, p in self.model.named_parameters()}}

    def counters(self) -> dict[str, float]:
        """This rank's process counters (:mod:`dovetail.engine.process_counters`) and its device allocator's counts
        (``alloc_retries``, ``device_allocs``, ``device_frees``, ``host_allocs``, ``host_alloc_us`` where the
        platform reports them)."""
        allocator = self.platform.memory_stats(self.local_rank)
        return {**process_counters(), **{name: allocator[name] for name in ALLOCATOR_COUNTS if name in allocator}}

    def start_timeline(self) -> None:
        """Start noting when this rank reaches each point of its steps (:mod:`dovetail.engine.step_timeline`)."""
        self.timeline.start()

    def stop_timeline(self) -> list[tuple[str, float]]:
        """Stop noting; the marks noted since :meth:`start_timeline`."""
        return self.timeline.stop()

    def start_profile(self, directory: str) -> None:
        self.profiler.start(directory)

    def stop_profile(self) -> str:
        """Stop the profiler; the path of this rank's summary (its trace is beside it)."""
        return self.profiler.stop()

    def token_digest(self) -> dict[str, list[int]]:
        """Every known token of every request this rank holds (to check that the ranks agree)."""
        return {rid: list(state.all_token_ids) for rid, state in self.requests.items()}

    def shutdown(self) -> None:
        distributed.destroy_tensor_parallel()
