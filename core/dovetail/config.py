"""Engine configuration: pydantic models with vLLM's names and defaults.

:class:`EngineArgs` is the flat form users pass (``LLM(**kwargs)``, CLI flags);
:meth:`EngineArgs.create_engine_config` groups it into an :class:`EngineConfig`
of model, cache, scheduler, device, parallel, structured-outputs, LoRA and speculative sections.
Any invalid value raises :class:`dovetail.errors.ConfigError` naming the field
and the rule.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dovetail.errors import ConfigError

DTYPE_CHOICES = ("auto", "float32", "float", "float16", "half", "bfloat16", "bf16")
KV_CACHE_DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")

#: Default KV-cache budget on platforms without a profiling run (the CPU).
DEFAULT_KV_CACHE_BYTES = 4 * 1024**3


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class ModelConfig(_Section):
    """Which model to load and how."""

    model: str
    tokenizer: Optional[str] = None
    dtype: Literal[DTYPE_CHOICES] = "auto"  # type: ignore[valid-type]
    max_model_len: Optional[int] = Field(default=None, gt=0)
    seed: int = Field(default=0, ge=0)
    load_format: Literal["auto", "safetensors", "dummy"] = "auto"
    quantization: Optional[str] = None
    served_model_name: Optional[str] = None
    #: Where requests' default sampling comes from: "auto" (the model's generation_config.json), "vllm"
    #: (SamplingParams' defaults) or a folder holding a generation_config.json.
    generation_config: str = "auto"
    #: Values set on top of those defaults, by a generation config's names (temperature, max_new_tokens, ...).
    override_generation_config: Optional[dict[str, Any]] = None
    #: "generate" (text), "pooling" (embeddings: ``LLM.embed``, ``/v1/embeddings``) or "auto": pooling for
    #: base-model checkpoints (architectures such as ``Qwen3Model``), else generate (see ``dovetail.pooling``).
    runner: Literal["auto", "generate", "pooling"] = "auto"
    #: The pooling runner's ``pooling_type`` (LAST, MEAN, CLS) and ``normalize``; unset ones come from the
    #: checkpoint's sentence-transformers files, else LAST with normalisation.
    pooler_config: Optional[dict[str, Any]] = None


class CacheConfig(_Section):
    """The paged KV cache."""

    block_size: int = Field(default=16, ge=1, le=1024)
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    enable_prefix_caching: bool = True
    kv_cache_dtype: Literal[KV_CACHE_DTYPE_CHOICES] = "auto"  # type: ignore[valid-type]
    #: Bytes of KV cache per device on platforms that do not profile (the CPU).
    kv_cache_memory_bytes: Optional[int] = Field(default=None, gt=0)
    num_gpu_blocks_override: Optional[int] = Field(default=None, gt=0)

    @field_validator("block_size")
    @classmethod
    def _block_size_power_of_two(cls, value):
        if value & (value - 1):
            raise ValueError("must be a power of two")
        return value


class SchedulerConfig(_Section):
    """Continuous batching limits."""

    #: None: the platform's default (256; 1024 on GPUs of 70 GiB or more, as vLLM).
    max_num_seqs: Optional[int] = Field(default=None, ge=1)
    max_num_batched_tokens: Optional[int] = Field(default=None, ge=1)
    enable_chunked_prefill: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    #: Schedule and prepare the next step while the device runs the current one (None: on accelerators).
    async_scheduling: Optional[bool] = None
    max_waiting_requests: Optional[int] = Field(default=None, ge=1)


class DeviceConfig(_Section):
    """Which hardware, attention backend and execution mode."""

    device: Optional[str] = None
    attention_backend: Optional[str] = None
    enforce_eager: bool = False
    #: Decode batch sizes captured as device graphs (None: vLLM's default list; see ``graph_batch_sizes``).
    cudagraph_capture_sizes: Optional[list[int]] = None
    #: Largest decode batch captured by default (None: 512).
    max_cudagraph_capture_size: Optional[int] = Field(default=None, ge=1)
    cpu_threads: Optional[int] = Field(default=None, ge=1)

    @field_validator("cudagraph_capture_sizes")
    @classmethod
    def _capture_sizes_positive(cls, value):
        if value is not None and (not value or any(size < 1 for size in value)):
            raise ValueError("must be a non-empty list of batch sizes of at least 1")
        return value


class ParallelConfig(_Section):
    """Parallelism across devices: ranks of tensor parallelism and the executor that runs them."""

    tensor_parallel_size: int = Field(default=1, ge=1)
    #: ``uni`` (in process; one rank), ``mp`` (a process per device on this host) or ``ray`` (Ray actors,
    #: across machines); None: ``uni`` for one rank, ``mp`` for more.
    distributed_executor_backend: Optional[Literal["uni", "mp", "ray"]] = None
    #: Dual-batch overlap: a step of at least ``dbo_prefill_token_threshold`` tokens runs as two micro-batches
    #: whose collectives overlap each other's compute (see ``dovetail.engine.micro_batches``). Off by default,
    #: as in vLLM: on H100 pairs joined by NVLink it has not beaten whole steps reliably (benchmarks/RESULTS.md).
    enable_dbo: bool = False
    dbo_prefill_token_threshold: int = Field(default=8192, ge=2)

    @field_validator("distributed_executor_backend")
    @classmethod
    def _uni_runs_one_rank(cls, value, info):
        size = info.data.get("tensor_parallel_size", 1)
        if value == "uni" and size > 1:
            raise ValueError(f"'uni' runs one rank in the engine's process; tensor_parallel_size={size} "
                             "needs 'mp' or 'ray'")
        return value


class StructuredOutputsConfig(_Section):
    """Structured outputs (vLLM's names)."""

    #: How the model's reasoning is delimited (``qwen3``, ``deepseek_r1``): grammars apply after it.
    reasoning_parser: Optional[str] = None
    #: Apply grammars to the reasoning too.
    enable_in_reasoning: bool = False

    @field_validator("reasoning_parser")
    @classmethod
    def _known_parser(cls, value):
        from dovetail.reasoning import reasoning_parser_names

        if value is not None and value not in reasoning_parser_names():
            raise ValueError(f"must be one of {', '.join(reasoning_parser_names())}")
        return value


class LoRAConfig(_Section):
    """Serving LoRA adapters beside the base model (vLLM's names and defaults)."""

    enable_lora: bool = False
    #: Adapters the running requests may use at once (each holds a slot of every linear layer).
    max_loras: int = Field(default=1, ge=1)
    #: The largest adapter rank the slots take.
    max_lora_rank: int = Field(default=16, ge=1)
    #: Adapters kept read in host memory (None: ``max_loras``); more are read again when used.
    max_cpu_loras: Optional[int] = Field(default=None, ge=1)

    @field_validator("max_cpu_loras")
    @classmethod
    def _at_least_max_loras(cls, value, info):
        loras = info.data.get("max_loras", 1)
        if value is not None and value < loras:
            raise ValueError(f"must be at least max_loras ({loras})")
        return value


class SpeculativeConfig(_Section):
    """Speculative decoding (vLLM's ``speculative_config``): each step proposes up to ``num_speculative_tokens``
    tokens per sequence, and one forward pass checks them all.

    ``ngram`` (prompt lookup) proposes the tokens that followed the latest earlier occurrence of the
    sequence's last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens (the longest that occurs). When
    neither bound is given both are 5; when one is given the other takes its value (vLLM's rule).
    """

    method: Literal["ngram"]
    num_speculative_tokens: int = Field(ge=1, le=64)
    prompt_lookup_max: Optional[int] = Field(default=None, ge=1)
    prompt_lookup_min: Optional[int] = Field(default=None, ge=1)
    #: No drafts while more sequences than this run or wait (None: drafts at any batch size): a large batch
    #: computes every draft of every sequence, which costs more than the accepted ones save.
    disable_by_batch_size: Optional[int] = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _lookup_bounds(self):
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = 5
        low, high = (high if low is None else low), (low if high is None else high)
        if low > high:
            raise ValueError(f"prompt_lookup_min ({low}) must not exceed prompt_lookup_max ({high})")
        self.__dict__.update(prompt_lookup_min=low, prompt_lookup_max=high)
        return self


class SpeculativeSection(_Section):
    """Where :class:`SpeculativeConfig` sits among the flat engine arguments (None: no speculation)."""

    speculative_config: Optional[SpeculativeConfig] = None


class EngineConfig(BaseModel):
    """The whole engine configuration, by section."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    device: DeviceConfig = DeviceConfig()
    parallel: ParallelConfig = ParallelConfig()
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()
    lora: LoRAConfig = LoRAConfig()
    speculative: SpeculativeSection = SpeculativeSection()


_SECTIONS = {
    "model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
    "device": DeviceConfig, "parallel": ParallelConfig, "structured_outputs": StructuredOutputsConfig,
    "lora": LoRAConfig, "speculative": SpeculativeSection,
}
_FIELD_SECTION = {name: section for section, cls in _SECTIONS.items() for name in cls.model_fields}


def format_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """One line per problem: ``field: rule (got value)``."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(part) for part in err["loc"]) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        got = err.get("input")
        shown = "" if isinstance(got, dict) or err["type"] == "missing" else f" (got {got!r})"
        lines.append(f"{prefix}{loc}: {msg}{shown}")
    return "; ".join(lines)


class EngineArgs:
    """Flat engine arguments, as ``LLM(**kwargs)`` and the CLI take them."""

    def __init__(self, model: str, **kwargs):
        self.kwargs = {"model": model, **kwargs}
        unknown = [k for k in self.kwargs if k not in _FIELD_SECTION]
        if unknown:
            known = ", ".join(sorted(_FIELD_SECTION))
            raise ConfigError(f"unknown engine argument(s) {', '.join(map(repr, unknown))}; known: {known}")

    def create_engine_config(self) -> EngineConfig:
        grouped: dict[str, dict] = {name: {} for name in _SECTIONS}
        for key, value in self.kwargs.items():
            if value is not None or key in ("model",):
                grouped[_FIELD_SECTION[key]][key] = value
        try:
            return EngineConfig(**{name: cls(**grouped[name]) for name, cls in _SECTIONS.items()})
        except ValidationError as exc:
            raise ConfigError(f"invalid engine argument: {format_validation_error(exc)}") from None
