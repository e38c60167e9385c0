"""Engine flags shared by every command that builds an engine (vLLM's names)."""

from __future__ import annotations

import argparse
import json

from dovetail.config import DTYPE_CHOICES, KV_CACHE_DTYPE_CHOICES
from dovetail.reasoning import reasoning_parser_names


def _bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def _json_object(value: str) -> dict:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


def add_engine_arguments(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """Add the engine's flags; the model is positional for ``serve`` and ``--model`` elsewhere."""
    if model_positional:
        parser.add_argument("model", nargs="?", default=None,
                            help="model directory (default: the bundled model)")
    else:
        parser.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    g = parser.add_argument_group("engine")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--device", default=None, help="platform: cpu, cuda, rocm, xpu, ... (env DOVETAIL_DEVICE)")
    g.add_argument("--attention-backend", default=None,
                   help="REFERENCE, TRITON, CPU_SIMD, FLASHINFER, FLASH_ATTN, ROCM_AITER, ... "
                        "(env DOVETAIL_ATTENTION_BACKEND)")
    g.add_argument("--quantization", "-q", default=None, help="fp8, int8, gptq, awq")
    g.add_argument("--dtype", default=None, choices=DTYPE_CHOICES, help="default: auto")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=None)
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV-cache budget on the CPU")
    g.add_argument("--kv-cache-dtype", default=None, choices=KV_CACHE_DTYPE_CHOICES)
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--enable-prefix-caching", type=_bool, default=None, metavar="BOOL")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--enable-chunked-prefill", type=_bool, default=None, metavar="BOOL")
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--scheduling-policy", default=None, choices=("fcfs", "priority"))
    g.add_argument("--async-scheduling", type=_bool, default=None, metavar="BOOL",
                   help="overlap scheduling with the device's work (default: on for accelerators)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--generation-config", default=None, metavar="auto|vllm|FOLDER",
                   help="default sampling of requests that set none: auto (the model's generation_config.json), "
                        "vllm (SamplingParams' defaults) or a folder holding a generation_config.json "
                        "(default: auto)")
    g.add_argument("--override-generation-config", type=_json_object, default=None, metavar="JSON",
                   help='values set on top of those defaults, e.g. \'{"temperature": 0.5, "max_new_tokens": 256}\'')
    g.add_argument("--load-format", default=None, choices=("auto", "safetensors", "dummy"))
    g.add_argument("--enforce-eager", action="store_true", default=None)
    g.add_argument("--cudagraph-capture-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="decode batch sizes captured as CUDA graphs (default: 1 2 4, every 8 to 256, then every 16)")
    g.add_argument("--max-cudagraph-capture-size", type=int, default=None,
                   help="largest decode batch captured by default (default: 512)")
    g.add_argument("--cpu-threads", type=int, default=None, help="CPU threads (default: OMP_NUM_THREADS or all)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="ranks of tensor parallelism, one device each (default 1)")
    g.add_argument("--distributed-executor-backend", default=None, choices=("uni", "mp", "ray"),
                   help="how ranks run: uni (in process, one rank), mp (a process per device on this host), "
                        "ray (Ray actors, across machines; pip install 'dovetail[ray]'); default: uni for one "
                        "rank, mp for more")
    g.add_argument("--enable-dbo", type=_bool, nargs="?", const=True, default=None, metavar="BOOL",
                   help="dual-batch overlap: run large steps as two micro-batches whose all-reduces overlap each "
                        "other's compute (default: off)")
    g.add_argument("--dbo-prefill-token-threshold", type=int, default=None, metavar="N",
                   help="smallest step split into micro-batches, in tokens (default 8192)")
    g.add_argument("--runner", default=None, choices=("auto", "generate", "pooling"),
                   help="generate text, or embed (pooling: /v1/embeddings, LLM.embed); default auto: pooling for "
                        "base-model checkpoints such as Qwen3Model")
    g.add_argument("--pooler-config", type=_json_object, default=None, metavar="JSON",
                   help='a pooling model\'s pooling and normalisation, e.g. \'{"pooling_type": "MEAN", '
                        '"normalize": false}\' (pooling_type LAST, MEAN or CLS; default: the checkpoint\'s '
                        'sentence-transformers settings, else LAST, normalised)')
    g.add_argument("--enable-lora", action="store_true", default=None,
                   help="serve LoRA adapters beside the model (LLM.generate(lora_request=...), --lora-modules)")
    g.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="adapters running requests may use at once (default 1)")
    g.add_argument("--max-lora-rank", type=int, default=None, metavar="R", help="the largest adapter rank (default 16)")
    g.add_argument("--max-cpu-loras", type=int, default=None, metavar="N",
                   help="adapters kept read in host memory (default: --max-loras)")
    g.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4}\' (n-gram lookup in the prompt and output so far; outputs stay '
                        'those of plain decoding)')
    g.add_argument("--reasoning-parser", default=None, choices=reasoning_parser_names(),
                   help="how the model's reasoning is delimited: qwen3, deepseek_r1 (structured outputs apply "
                        "after it; the server returns it as reasoning_content)")


ENGINE_KEYS = (
    "tokenizer", "device", "attention_backend", "quantization", "dtype", "max_model_len", "block_size",
    "gpu_memory_utilization", "kv_cache_memory_bytes", "kv_cache_dtype", "num_gpu_blocks_override",
    "enable_prefix_caching", "enable_chunked_prefill", "max_num_seqs", "max_num_batched_tokens",
    "scheduling_policy", "async_scheduling", "seed", "load_format", "enforce_eager",
    "cudagraph_capture_sizes", "max_cudagraph_capture_size", "cpu_threads", "tensor_parallel_size",
    "distributed_executor_backend", "enable_dbo", "dbo_prefill_token_threshold", "reasoning_parser",
    "generation_config", "override_generation_config", "runner", "pooler_config",
    "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "speculative_config",
)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine arguments the user set (unset flags keep the engine's defaults)."""
    kwargs = {k: getattr(args, k) for k in ENGINE_KEYS if getattr(args, k, None) is not None}
    return kwargs
