"""LLMEngine: selection, the workers, and the add-request / step loop.

Start-up: load plugins, choose the platform, read the model's config, resolve
dtype and ``max_model_len``, choose the attention backend, the quantization
method and the model class, start the workers through the executor (each builds
and loads its model shard), size the KV cache (the minimum over the ranks), and
set up the scheduler. Each :meth:`LLMEngine.step` schedules a batch, hands its
description to the workers (they run the model and sample), applies the sampled
tokens and the stop rules, and returns the requests' progress. A pooling model's
steps bring back pooled states instead, one per prompt they complete
(:mod:`dovetail.engine.pooling_model`).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Iterable, Union

import torch

from dovetail.config import EngineArgs, EngineConfig
from dovetail.engine.kv_cache_manager import KVCacheManager
from dovetail.engine.laps import Laps
from dovetail.engine.output_processor import OutputProcessor
from dovetail.engine.pooling_model import POOLING_ROW, PoolingModel
from dovetail.engine.profiler import profiler_dir
from dovetail.engine.prompt_tokenizer import PromptTokenizer
from dovetail.engine.request import Request, RequestStatus
from dovetail.engine.scheduler import ScheduledBatch, Scheduler
from dovetail.engine.speculative import NgramProposer
from dovetail.engine.step import NewRequestData, StepDescription
from dovetail.engine.structured_output import StructuredOutputManager
from dovetail.engine.worker import WorkerSpec, attention_requirements, check_heads_divide
from dovetail.errors import ConfigError, RequestError, WorkerError
from dovetail.executor import create_executor, executor_backend, start_processes_early
from dovetail.lora.registry import AdapterRegistry
from dovetail.lora.request import LoRARequest
from dovetail import generation_defaults, model_loader, pooling
from dovetail.outputs import PoolingRequestOutput, RequestOutput
from dovetail.pooling import PoolingParams
from dovetail.plugin_manager import get_plugin_manager
from dovetail.reasoning import ReasoningParser
from dovetail.sampling_params import RequestOutputKind, SamplingParams
from dovetail import selection

logger = logging.getLogger("dovetail")

#: vLLM's default cap on requested logprobs.
MAX_LOGPROBS = 20

PromptType = Union[str, list[int], dict]


@dataclass
class _InFlight:
    """A launched step: the requests of the rows it samples, in order, and whether some rows carry drafts
    (the next step's positions then wait for how many were accepted)."""

    requests: list[Request]
    speculative: bool = False


@dataclass
class _Parent:
    """A user request and its ``n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]


def _phases_text(phases: dict[str, float]) -> str:
    return ", ".join(f"{name.removesuffix('_s').replace('_', ' ')} {seconds:.1f}s" for name, seconds in phases.items())


class LLMEngine:
    """The synchronous engine behind :class:`dovetail.LLM` and the server."""

    def __init__(self, config: EngineConfig, usage: str = "llm"):
        laps = Laps()
        self.config = config
        #: ``"llm"`` (offline) or ``"server"``: which of the platform's default batch limits apply.
        self.usage = usage
        manager = get_plugin_manager()
        mc = config.model
        self.model_path = model_loader.resolve_model_path(mc.model)

        platform_name = selection.resolve_platform_name(config.device.device, manager)
        self.platform = selection.create_platform(platform_name, manager)
        config.device.device = platform_name
        self.platform.check_and_update_config(config)
        parallel = config.parallel
        self.world_size = parallel.tensor_parallel_size
        self.executor_name = executor_backend(self.world_size, parallel.distributed_executor_backend)
        if self.executor_name == "mp":
            self.platform.check_world_size(self.world_size)
        if self.executor_name == "uni":
            self.platform.set_device(0)
        started = start_processes_early(self.executor_name, self.world_size, str(self.model_path))
        try:
            spec = self._configure(manager)
            laps.mark("config_s")
            self.executor = create_executor(spec, self.platform, started)
        except BaseException:
            if started is not None:
                started.shutdown()
            raise
        laps.mark("workers_and_weights_s")
        try:
            self.num_blocks = self.executor.determine_num_blocks()
            laps.mark("memory_profile_s")
            self.executor.initialize_cache(self.num_blocks)
            laps.mark("kv_cache_and_graphs_s")
            #: Each rank's own start-up phases (:attr:`dovetail.engine.worker.Worker.startup_phases`), by rank.
            self.worker_startup_phases: list[dict[str, float]] = self.executor.collective_rpc("startup_report")
        except BaseException:
            self.executor.shutdown()
            raise
        #: Seconds of the start-up's phases: the configuration and selections, the workers with their weights,
        #: the memory-profiling pass, the KV cache with the device graphs.
        self.startup_phases = laps.seconds
        self._init_scheduling_and_outputs(config, platform_name, laps.started)

    def _configure(self, manager) -> WorkerSpec:
        """The model's configuration, dtype, lengths and limits, the model class, attention backend,
        quantization and tokenizer; the spec every worker gets."""
        config, mc = self.config, self.config.model
        self.hf_config = model_loader.load_hf_config(self.model_path)
        self.dtype = self._resolve_dtype()
        self.max_model_len = self._resolve_max_model_len()
        self._resolve_scheduler_limits()

        architectures = getattr(self.hf_config, "architectures", None) or []
        mc.runner = pooling.resolve_runner(mc.runner, architectures)
        #: Whether the model pools (``runner="pooling"``: embeds or classifies) instead of generating.
        self.is_pooling = mc.runner == "pooling"
        #: A pooling model's settings, task and classifier head (None for a generating model).
        self.pooling_model: PoolingModel | None = None
        self.model_choice = selection.select_model_class(pooling.candidate_architectures(architectures, mc.runner),
                                                         manager)
        if self.is_pooling:
            self._configure_pooling()
            if config.lora.enable_lora:
                raise ConfigError("enable_lora: LoRA adapters run on generating models only (runner='generate')")
            if config.speculative.speculative_config is not None:
                raise ConfigError("speculative_config: speculative decoding runs on generating models only "
                                  "(runner='generate')")
        shape = self.model_choice.cls.attention_shape(self.hf_config)
        check_heads_divide(shape, self.world_size)
        spec = WorkerSpec(config, str(self.model_path), self.dtype, self.max_model_len)
        self.attention_backend = selection.select_attention_backend(
            self.platform, attention_requirements(spec, self.platform, shape), config.device.attention_backend,
            manager)
        config.device.attention_backend = self.attention_backend.name
        self.quant_method = selection.select_quant_method(
            self.platform, self.dtype, mc.quantization, model_loader.quantization_config(self.hf_config), manager)

        #: Where the tokenizer comes from: the ``tokenizer`` argument, else the model's directory.
        self.tokenizer_path = model_loader.resolve_tokenizer_path(mc.tokenizer) if mc.tokenizer else self.model_path
        self.tokenizer = model_loader.load_tokenizer(self.tokenizer_path)
        self.prompt_tokenizer = PromptTokenizer(self.tokenizer, self.max_model_len)
        self.vocab_size = int(self.hf_config.vocab_size)
        self.eos_token_ids = self._eos_token_ids()
        self._eos_frozen = frozenset(self.eos_token_ids)
        #: The sampling fields a request that sets none of them gets (:mod:`dovetail.generation_defaults`).
        self.default_sampling = {} if self.is_pooling else generation_defaults.default_sampling_values(
            self.model_path, mc.generation_config, mc.override_generation_config)
        if self.default_sampling:
            logger.info("default sampling parameters from the model's generation config: %s (a request's own "
                        "values come first; --generation-config vllm ignores them)",
                        generation_defaults.describe(self.default_sampling))
        return spec

    def _configure_pooling(self) -> None:
        """The pooler's settings, and no prefix caching where the pooling needs every token's hidden state."""
        mc = self.config.model
        mc.pooler_config = pooling.resolve_pooler_config(self.model_path, mc.pooler_config)
        self.pooling_model = PoolingModel(self.model_path, self.hf_config, mc.pooler_config)
        pooling_type = self.pooling_model.pooling_type
        if pooling_type != "LAST" and self.config.cache.enable_prefix_caching:
            self.config.cache.enable_prefix_caching = False
            logger.info("prefix caching off: %s pooling needs every prompt token computed", pooling_type)
        logger.info("pooling model: %s", self.pooling_model.describe())

    def _init_scheduling_and_outputs(self, config: EngineConfig, platform_name: str, t0: float) -> None:
        """The KV-cache manager, scheduler, output processing and request books, once the workers are up."""
        self.kv_manager = KVCacheManager(self.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv_manager, self.max_model_len)
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        so = config.structured_outputs
        self.reasoning = ReasoningParser(so.reasoning_parser, self.tokenizer) if so.reasoning_parser else None
        tokenizer_path = self.tokenizer_path  # (a closure over self would keep a dropped engine's workers alive)
        self.structured = StructuredOutputManager(lambda: model_loader.load_tokenizer(tokenizer_path),
                                                  self.vocab_size, self.eos_token_ids, self.reasoning,
                                                  so.enable_in_reasoning, pin_memory=self._pins_host_memory())
        self._num_constrained = 0  # unfinished user requests with structured outputs
        lora = config.lora
        #: The LoRA adapters the workers hold (None: LoRA is off).
        self.loras = (AdapterRegistry(self.executor.collective_rpc, lora.max_cpu_loras or lora.max_loras)
                      if lora.enable_lora else None)
        self._parents: dict[str, _Parent] = {}
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._in_flight: _InFlight | None = None
        self._forget: list[str] = []  # requests the workers drop before the next step
        self.failure: WorkerError | None = None
        self._profiling = False
        async_scheduling = config.scheduler.async_scheduling
        self.overlap = self.platform.is_accelerator if async_scheduling is None else async_scheduling
        speculative = config.speculative.speculative_config
        #: Proposes each step's draft tokens (None: no speculative decoding).
        self.proposer = NgramProposer(speculative, self.max_model_len) if speculative is not None else None
        #: Draft tokens proposed, and of them accepted, since start-up.
        self.num_draft_tokens = self.num_accepted_tokens = 0
        if self.proposer is not None:
            self.proposer.graph_batch = max(self.executor.collective_rpc("verify_graph_sizes")[0] or [0])
        if speculative is not None:
            logger.info("speculative decoding: n-gram drafts of up to %d tokens, looked up by the last %d to %d "
                        "tokens%s", speculative.num_speculative_tokens, speculative.prompt_lookup_max,
                        speculative.prompt_lookup_min,
                        "" if speculative.disable_by_batch_size is None
                        else f", none while more than {speculative.disable_by_batch_size} sequences run or wait")
        self.startup_seconds = time.monotonic() - t0
        logger.info("engine ready in %.1fs: model %s (%s) on %s, dtype %s, attention %s, %d KV blocks of %d tokens, "
                    "world size %d (executor %s)", self.startup_seconds, self.model_path,
                    self.model_choice.architecture, platform_name, str(self.dtype).removeprefix("torch."),
                    self.attention_backend.name, self.num_blocks, config.cache.block_size, self.world_size,
                    self.executor_name)
        logger.info("start-up: %s; the slowest rank's: %s",
                    _phases_text(self.startup_phases), _phases_text(self.slowest_rank_startup()))

    def slowest_rank_startup(self) -> dict[str, float]:
        """The start-up phases of the rank that took longest to come up."""
        return max(self.worker_startup_phases, key=lambda phases: sum(phases.values()))

    def _pins_host_memory(self) -> bool:
        """Whether host buffers bound for the device are pinned: only where this process drives it (other
        executors ship them to their ranks, and pinning here would open a device context on the first
        GPU for nothing)."""
        return self.platform.is_accelerator and self.executor.name == "uni"

    @classmethod
    def from_engine_args(cls, model: str, **kwargs) -> "LLMEngine":
        return cls(EngineArgs(model, **kwargs).create_engine_config())

    # -- start-up steps ----------------------------------------------------------------------

    def _resolve_dtype(self) -> torch.dtype:
        requested = self.config.model.dtype
        supported = self.platform.supported_dtypes()
        if requested == "auto":
            dtype = self.platform.resolve_dtype(model_loader.checkpoint_dtype(self.hf_config))
        else:
            dtype = model_loader.DTYPES[requested]
            if dtype not in supported:
                names = ", ".join(str(d).removeprefix("torch.") for d in supported)
                raise ConfigError(f"dtype: {requested} is not supported on device {self.platform.name!r} "
                                  f"(supported: {names})")
        return dtype

    def _resolve_max_model_len(self) -> int:
        derived = model_loader.max_position_embeddings(self.hf_config)
        requested = self.config.model.max_model_len
        if requested is None:
            if derived is None:
                raise ConfigError("max_model_len: the model's config gives no maximum length; set max_model_len")
            return derived
        if derived is not None and requested > derived:
            raise ConfigError(f"max_model_len: {requested} exceeds the model's maximum of {derived} "
                              "(max_position_embeddings in config.json)")
        return requested

    def _resolve_scheduler_limits(self) -> None:
        sched = self.config.scheduler
        default_tokens, default_seqs = self.platform.default_batch_limits(self.usage)
        if sched.max_num_seqs is None:
            sched.max_num_seqs = default_seqs
        if sched.max_num_batched_tokens is None:
            default = default_tokens if sched.enable_chunked_prefill else max(default_tokens, self.max_model_len)
            sched.max_num_batched_tokens = max(default, sched.max_num_seqs)
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens: {sched.max_num_batched_tokens} is smaller than max_model_len "
                f"({self.max_model_len}); without chunked prefill a whole prompt must fit in one step")

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        value = getattr(self.hf_config, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
        value = generation_defaults.read_generation_config(self.model_path).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(value)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    # -- requests ---------------------------------------------------------------------------

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.prompt_tokenizer.encode(prompt, add_special_tokens, allow_empty=True)

    def pair_token_ids(self, firsts: list[str], seconds: list[str]) -> list[list[int]]:
        """The token ids of each text pair, as a cross-encoder reads them (the tokenizer's pair encoding)."""
        many = len(firsts) > 1
        return [self.prompt_tokenizer.encode_pair(a, b, (f"text_1.{i}" if many else "text_1",
                                                         f"text_2.{i}" if many else "text_2"))
                for i, (a, b) in enumerate(zip(firsts, seconds))]

    def prompt_ids(self, prompt: PromptType, bounded: bool = True) -> tuple[str | None, list[int]]:
        """The prompt's text (if any) and token ids; ``bounded``: refuse a text surely longer than the context
        before tokenising it (not when the request truncates its prompt)."""
        if isinstance(prompt, str):
            return prompt, self.prompt_tokenizer.encode(prompt, bounded=bounded)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.prompt_tokenizer.encode(prompt["prompt"], bounded=bounded)
            raise RequestError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'", field="prompt")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise RequestError(f"prompt: expected a string, a list of token ids or a dict, got {type(prompt).__name__}",
                           field="prompt")

    def validate_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Reject what can never run, naming the field: bad token ids, lengths beyond the context."""
        if not prompt_ids:
            raise RequestError("prompt: the prompt is empty", field="prompt")
        if len(prompt_ids) >= self.max_model_len:  # before looking at millions of ids
            raise RequestError(f"prompt: the prompt has {len(prompt_ids)} tokens, but max_model_len is "
                               f"{self.max_model_len} (at least one token must be generated)", field="prompt")
        self._check_token_ids(prompt_ids)
        if params.max_tokens is not None and len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"max_tokens: the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                f"exceeds max_model_len ({self.max_model_len})", field="max_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > MAX_LOGPROBS:
                raise RequestError(f"{name}: {value} exceeds the maximum of {MAX_LOGPROBS}", field=name)
        params.validate_for_vocab(self.vocab_size)

    def _check_token_ids(self, prompt_ids: list[int]) -> None:
        for t in prompt_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise RequestError(f"prompt_token_ids: token id {t!r} is out of range [0, {self.vocab_size})",
                                   field="prompt_token_ids")

    def validate_pooling_request(self, prompt_ids: list[int], params: PoolingParams) -> None:
        """Reject a pooling request that can never run, naming the field."""
        if not prompt_ids:
            raise RequestError("input: the prompt is empty", field="input")
        if len(prompt_ids) > self.max_model_len:
            raise RequestError(f"input: the prompt has {len(prompt_ids)} tokens, but max_model_len is "
                               f"{self.max_model_len}", field="input")
        self._check_token_ids(prompt_ids)
        self.pooling_model.check(params)

    def _check_runner(self, params) -> None:
        if self.is_pooling and not isinstance(params, PoolingParams):
            raise RequestError("model: this model runs as a pooling model (runner='pooling'): it embeds or "
                               "classifies prompts (LLM.embed, LLM.classify, LLM.score; /v1/embeddings, /classify, "
                               "/score, /rerank) and generates no text", field="model")
        if not self.is_pooling and isinstance(params, PoolingParams):
            raise RequestError("model: this model generates text (runner='generate'): start it with "
                               "runner='pooling' (--runner pooling) to embed or classify", field="model")

    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams | PoolingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None) -> str:
        """Queue a request (:class:`PoolingParams` for a pooling model), with a LoRA adapter when
        ``lora_request`` is set; raise :class:`RequestError` if it can never run."""
        if params is None:
            params = PoolingParams() if self.is_pooling else SamplingParams(**self.default_sampling)
        self._check_runner(params)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._parents:
            raise RequestError(f"request_id: {request_id!r} is already in use", field="request_id")
        if priority != 0 and self.config.scheduler.scheduling_policy != "priority":
            raise RequestError("priority: set scheduling_policy='priority' to use request priorities",
                               field="priority")
        truncates = self.is_pooling and params.truncate_prompt_tokens is not None
        text, ids = self.prompt_ids(prompt, bounded=not truncates)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        if self.is_pooling:
            self._check_lora(lora_request)  # refused: no pooling model serves adapters
            ids = params.truncated(ids, self.max_model_len)
            self.validate_pooling_request(ids, params)
            request = Request(request_id, text, ids, POOLING_ROW, self.eos_token_ids, arrival, priority)
            request.pooling_params = params
            self._parents[request_id] = _Parent(request_id, text, ids, [request])
            self._requests[request_id] = request
            self.scheduler.add(request)
            return request_id
        self.validate_request(ids, params)
        self._check_lora(lora_request)
        grammar = self._grammar(params)
        children = []
        for i in range(params.n):
            child_params = params.child(i) if params.n > 1 else params
            if child_params.max_tokens is None:
                child_params = child_params.model_copy(update={"max_tokens": self.max_model_len - len(ids)})
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            child = Request(child_id, text, ids, child_params, self.eos_token_ids, arrival, priority,
                            parent_id=request_id, index=i)
            child.lora_request = lora_request
            self.outputs.attach(child)
            if grammar is not None:
                self.structured.attach(child, grammar)
            children.append(child)
        self._parents[request_id] = _Parent(request_id, text, ids, children)
        self._num_constrained += grammar is not None
        for child in children:
            self._requests[child.request_id] = child
            self.scheduler.add(child)
        return request_id

    def _check_lora(self, lora_request: LoRARequest | None) -> None:
        """Have the workers hold the request's adapter, or refuse the request naming ``lora_request``."""
        if lora_request is not None:
            self.add_lora(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Have every rank read the adapter now (requests naming it later find it read); a
        :class:`RequestError` naming ``lora_request`` says why it cannot run."""
        if not isinstance(lora_request, LoRARequest):
            raise RequestError(f"lora_request: expected a LoRARequest, got {type(lora_request).__name__}",
                               field="lora_request")
        if self.loras is None:
            raise RequestError("lora_request: LoRA adapters are not enabled; start the engine with "
                               "enable_lora=True (--enable-lora)", field="lora_request")
        self.loras.ensure(lora_request, lambda: {r.lora_request.lora_int_id for r in self._requests.values()
                                                 if r.lora_request is not None})

    def _grammar(self, params: SamplingParams):
        """The compiled grammar (a future) of a constrained request, else None."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise RequestError("structured_outputs: this model has no tokenizer, which constraints need",
                               field="structured_outputs")
        return self.structured.grammar_for(params.structured_outputs)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now and free their KV-cache blocks."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            self._drop_parent(parent)
            for child in parent.children:
                if not child.is_finished:
                    self.scheduler.abort(child)
                    self.outputs.finish(child, "abort")
                    self._drop_from_workers(child)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is unfinished, or a launched step still has to be applied."""
        return bool(self._parents) or self._in_flight is not None

    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    # -- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return the progress of every request that advanced or finished.

        With overlapped (async) scheduling, a step launches its batch on the workers
        and then applies the tokens of the step before, so the host schedules and
        prepares while the devices compute; a request's newest token then feeds
        the next step from the device. Requests whose penalties need the host to
        know every token so far wait for the step in flight first. A constrained
        row needs its newest token only for its bitmask: the workers run the
        model while that token is applied, and sample once the bitmask follows. With speculative decoding
        the drafts need every token so far: a step waits for the one before when the proposer asks
        (:meth:`~dovetail.engine.speculative.NgramProposer.wants_tokens`), and always after a step with drafts.

        A worker that died or failed raises :class:`WorkerError` naming its rank;
        the engine is stopped from then on (every later step raises it again).
        """
        if self.failure is not None:
            raise WorkerError(f"the engine stopped: {self.failure}", self.failure.rank)
        try:
            return self._step()
        except WorkerError as exc:
            self.failure = exc
            self._in_flight = None
            raise
        except BaseException:
            self._reset_workers()
            raise

    def _step(self) -> list[RequestOutput]:
        outputs = self._fail_broken_grammars() if self.structured.waiting else []
        if self._in_flight is not None and (not self.overlap or self._needs_every_token()
                                            or self._in_flight.speculative
                                            or (self.proposer is not None and self.proposer.wants_tokens())):
            outputs += self._apply(self._in_flight)
            self._in_flight = None
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running, allowed=not self._num_constrained,
                                  num_waiting=len(self.scheduler.waiting))
        batch = self.scheduler.schedule()
        for req in batch.preempted:
            self._drop_from_workers(req)
        launched = None
        if batch:
            launched, deferred = self._launch(batch)
            if deferred:  # the bitmask needs the tokens of the step in flight: apply them while the model runs
                outputs += self._apply(self._in_flight)
                self._in_flight = None
                self.executor.sample_with_bitmask(*self.structured.bitmask(launched.requests))
        elif self._in_flight is None and self.structured.waiting:
            self.structured.wait(0.05)  # nothing can run before a grammar is ready
        if self._in_flight is not None:
            outputs += self._apply(self._in_flight)
        self._in_flight = launched
        if launched is not None and not self.overlap:
            outputs += self._apply(launched)
            self._in_flight = None
        return outputs

    def _needs_every_token(self) -> bool:
        return any(r.num_pending and (r.params.repetition_penalty != 1.0 or r.params.presence_penalty
                                      or r.params.frequency_penalty) for r in self.scheduler.running)

    def _drop_from_workers(self, req: Request) -> None:
        """The workers forget ``req`` before the next step (finished, aborted or preempted)."""
        if req.on_workers:
            req.on_workers = False
            self._forget.append(req.request_id)

    def _reset_workers(self) -> None:
        """After a failed step: the workers drop every request and launched step (the caller aborts the
        requests); a worker that cannot be reset stops the engine."""
        self._in_flight = None
        self._forget = []
        for req in self._requests.values():
            req.on_workers = False
            req.num_pending = 0
        try:
            self.executor.collective_rpc("reset")
        except WorkerError as exc:
            self.failure = exc

    def describe_step(self, batch: ScheduledBatch) -> StepDescription:
        """The workers' view of ``batch``: new requests in full, then only the blocks each one gained."""
        new_requests, new_blocks = [], {}
        block_ids = self.kv_manager.block_ids
        for req in batch.requests:
            blocks = block_ids(req.request_id)
            if not req.on_workers:
                if req.num_pending:
                    raise RuntimeError(f"request {req.request_id} is sent to the workers with tokens pending")
                new_requests.append(NewRequestData(req.request_id, req.prompt_token_ids, req.output_token_ids[:],
                                                   req.params, self._eos_frozen, blocks[:], req.num_computed_tokens,
                                                   req.lora_request))
                req.on_workers = True
                req.num_sent_blocks = len(blocks)
            elif len(blocks) > req.num_sent_blocks:
                new_blocks[req.request_id] = blocks[req.num_sent_blocks:]
                req.num_sent_blocks = len(blocks)
        forget, self._forget = self._forget, []
        drafts = {r.request_id: list(r.draft_token_ids) for r in batch.requests if r.draft_token_ids}
        return StepDescription([r.request_id for r in batch.requests], batch.num_new_tokens, new_requests,
                               new_blocks, forget, draft_token_ids=drafts)

    def _launch(self, batch: ScheduledBatch) -> tuple[_InFlight, bool]:
        """Hand the step to the workers; nothing waits for them. Returns the requests whose rows sample, and
        whether the workers wait for their bitmask (:meth:`Executor.sample_with_bitmask`) before sampling."""
        step = self.describe_step(batch)
        rows = [req for req, n in zip(batch.requests, batch.num_new_tokens)
                if req.num_computed_tokens + n == req.num_tokens + len(req.draft_token_ids)]
        deferred = False
        if self._num_constrained and rows:
            if self._in_flight is not None and self.structured.needs_host_tokens(rows):
                step.sample_later = deferred = True
            else:
                step.token_bitmask, step.bitmask_rows = self.structured.bitmask(rows)
        self.executor.execute_model(step)
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
        max_model_len = self.max_model_len
        for req in rows:
            req.num_pending += 1
            if (req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len
                    or req.pooling_params is not None):
                req.stop_scheduling = True  # it finishes with this token whatever its value
        return _InFlight(rows, bool(step.draft_token_ids)), deferred

    def _fail_broken_grammars(self) -> list[RequestOutput]:
        """Finish (as aborted) the requests whose grammar failed to compile."""
        touched = {}
        for req, reason in self.structured.poll():
            logger.error("request %s: its grammar failed to compile: %s", req.parent_id, reason)
            if req.request_id in self._requests and not req.is_finished:
                self.scheduler.abort(req)
                self.outputs.finish(req, "abort")
                touched[req.parent_id] = None
        return [self._parent_output(pid) for pid in touched if pid in self._parents]

    def _apply(self, in_flight: _InFlight) -> list[RequestOutput]:
        """Wait for a launched step's tokens, apply them and the stop rules, and build the outputs."""
        result = self.executor.take_output()
        if self.is_pooling:
            return self._apply_pooled(in_flight, result.embeddings)
        if len(result.token_ids) != len(in_flight.requests):
            raise RuntimeError(f"rank 0 sampled {len(result.token_ids)} tokens for a step of "
                               f"{len(in_flight.requests)} sampled rows")
        for request_id, (positions, infos) in result.prompt_logprobs.items():
            req = self._requests.get(request_id)
            if req is not None:
                self.outputs.add_prompt_logprobs(req, positions, infos)
        now = time.monotonic()
        touched: dict[str, None] = {}
        constrained = []
        for row, (req, token, info) in enumerate(zip(in_flight.requests, result.token_ids, result.logprobs)):
            req.num_pending -= 1
            accepted = ()  # a speculative row's tokens after its first
            if req.draft_token_ids:
                accepted = result.draft_rows.get(row, ())
                self._settle_drafts(req, len(accepted))
            if req.is_finished or req.request_id not in self._requests:
                continue  # finished by an earlier token, or aborted, while this step ran
            self.outputs.append_token(req, token, info, now)
            for token, info in accepted:
                if req.is_finished:
                    break
                self.outputs.append_token(req, token, info, now)
            if req.grammar is not None and not req.is_finished:
                constrained.append((req, token))
            if req.is_finished:
                self.scheduler.finish(req)
                self._drop_from_workers(req)
            touched[req.parent_id] = None
        for req in self.structured.accept(constrained) if constrained else ():
            self.outputs.finish(req, "stop")  # the grammar has ended (with ignore_eos, EOS alone does not stop)
            self.scheduler.finish(req)
            self._drop_from_workers(req)
        outputs = []
        for pid in touched:
            parent = self._parents.get(pid)
            if parent is None:
                continue
            final_only = parent.children[0].params.output_kind == RequestOutputKind.FINAL_ONLY
            if final_only and not all(c.is_finished for c in parent.children):
                continue
            outputs.append(self._parent_output(pid))
        return outputs

    def _settle_drafts(self, req: Request, accepted: int) -> None:
        """Count a speculative row's drafts, and take back the computed positions of those not accepted (their
        cache slots are written again when the sequence gets there)."""
        drafted = len(req.draft_token_ids)
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        req.num_computed_tokens -= drafted - accepted
        req.draft_token_ids = []

    def _apply_pooled(self, in_flight: _InFlight, embeddings) -> list[PoolingRequestOutput]:
        """Finish the requests whose prompt a pooling step completed, with their embeddings (or their
        classifier's probabilities, or scores)."""
        count = 0 if embeddings is None else len(embeddings)
        if count != len(in_flight.requests):
            raise RuntimeError(f"rank 0 pooled {count} prompts for a step that completed {len(in_flight.requests)}")
        now = time.monotonic()
        outputs = []
        for req, pooled in zip(in_flight.requests, embeddings if count else ()):
            req.num_pending -= 1
            if req.is_finished or req.request_id not in self._requests:
                continue  # aborted while the step ran
            req.finish_reason, req.status = "stop", RequestStatus.FINISHED
            req.metrics.finished_time = req.metrics.first_token_time = now
            self.scheduler.finish(req)
            self._drop_from_workers(req)
            self._drop_parent(self._parents.pop(req.parent_id))
            outputs.append(self.pooling_model.output(req, torch.from_numpy(pooled)))
        return outputs

    def _parent_output(self, parent_id: str) -> RequestOutput:
        parent = self._parents[parent_id]
        output = self.outputs.request_output(parent.request_id, parent.prompt, parent.prompt_token_ids,
                                             parent.children)
        if output.finished:
            del self._parents[parent_id]
            self._drop_parent(parent)
        return output

    def _drop_parent(self, parent: _Parent) -> None:
        for child in parent.children:
            self._requests.pop(child.request_id, None)
            if child.grammar is not None:
                self.structured.forget(child)
        self._num_constrained -= parent.children[0].grammar is not None

    # -- introspection --------------------------------------------------------------------------

    def _local_worker(self):
        worker = getattr(self.executor, "worker", None)
        if worker is None:
            raise AttributeError(f"the model lives in {self.world_size} worker processes (executor "
                                 f"{self.executor_name!r}), not in the engine's process")
        return worker

    @property
    def model(self):
        """The model (executor ``uni`` only: other executors hold it in their workers)."""
        return self._local_worker().model

    @property
    def runner(self):
        """The model runner (executor ``uni`` only)."""
        return self._local_worker().runner

    @property
    def device(self):
        return self._local_worker().device

    def check_health(self) -> None:
        """Raise :class:`WorkerError` if a worker is gone (the engine is then stopped for good)."""
        if self.failure is not None:
            raise WorkerError(f"the engine stopped: {self.failure}", self.failure.rank)
        try:
            self.executor.check_health()
        except WorkerError as exc:
            self.failure = exc
            self._in_flight = None
            raise

    def start_profile(self) -> None:
        """Start torch.profiler on every rank, writing to ``DOVETAIL_TORCH_PROFILER_DIR`` (see
        :mod:`dovetail.engine.profiler`); a ConfigError when it is unset or the profiler runs already."""
        directory = profiler_dir()
        if self._profiling:
            raise ConfigError("the profiler is already running: stop it first")
        self.executor.collective_rpc("start_profile", directory)
        self._profiling = True

    def stop_profile(self) -> list[str]:
        """Stop the profiler on every rank once the steps queued so far have run; each rank's summary path."""
        if not self._profiling:
            raise ConfigError("the profiler is not running: start it first")
        self._profiling = False
        return self.executor.collective_rpc("stop_profile")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, so that the next requests compute their prompts in full (as vLLM's
        ``reset_prefix_cache``); False, and nothing forgotten, while requests are unfinished."""
        if self.scheduler.has_work():
            return False
        return self.kv_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the workers (their processes, with executors other than ``uni``) and the grammar compiler's
        threads."""
        self.executor.shutdown()
        self.structured.shutdown()

    def stats(self) -> dict:
        """Queue sizes and cache usage (for metrics)."""
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_cache_usage": self.kv_manager.usage(),
            "prefix_cache_hit_rate": self.kv_manager.hit_rate(),
            "num_preemptions": self.scheduler.num_preemptions,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
        }
