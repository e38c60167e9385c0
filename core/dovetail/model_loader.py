"""Loading a local HF model directory: config, tokenizer and safetensors weights.

Weights are read tensor by tensor through safetensors' memory map and copied
straight into the model's parameters (converted to the model's dtype), so the
peak memory stays close to the size of the weights. Nothing is downloaded: a
hub id is accepted only if the hub's local cache already holds it.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Callable, Iterator

import torch

from dovetail.checkpoint_tensor import CheckpointTensor, read
from dovetail.distributed import tp_size
from dovetail.errors import ModelLoadError

logger = logging.getLogger("dovetail")

DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def resolve_model_path(model: str) -> Path:
    """The local directory of ``model``: a path, or a hub id found in the local hub cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model directory {str(path)!r} has no config.json")
        return path
    if path.exists():
        raise ModelLoadError(f"model {model!r} is a file; pass the model's directory")
    looks_like_hub_id = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    if looks_like_hub_id:
        cached = _from_hub_cache(model)
        if cached is not None:
            return cached
        raise ModelLoadError(
            f"model {model!r} is not a local directory and is not in the local Hugging Face cache; "
            "Dovetail does not download models at run time. Download it first "
            f"(e.g. `huggingface-cli download {model} --local-dir DIR`) and pass DIR")
    raise ModelLoadError(f"model path {model!r} does not exist")


def _from_hub_cache(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:
        return None


def load_hf_config(path: Path):
    """The model's ``config.json`` through transformers."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except Exception as exc:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {exc}") from exc


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def resolve_tokenizer_path(tokenizer: str) -> Path:
    """The directory of the ``tokenizer`` engine argument: a path, or a hub id in the local hub cache, holding
    a tokenizer (an error naming the argument otherwise)."""
    path = Path(tokenizer).expanduser()
    if not path.is_dir() and tokenizer.count("/") == 1 and not tokenizer.startswith((".", "/", "~")):
        path = _from_hub_cache(tokenizer) or path
    if not path.is_dir():
        raise ModelLoadError(f"tokenizer: {tokenizer!r} is not a directory (nor a model in the local Hugging Face "
                             "cache); pass the directory that holds the tokenizer")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"tokenizer: {str(path)!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    return path


def load_tokenizer(path: Path):
    """The tokenizer through transformers, or None when the directory has none."""
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {str(path)!r}: {exc}") from exc


def checkpoint_dtype(hf_config) -> torch.dtype | None:
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, str):
        return DTYPES.get(value)
    return value if isinstance(value, torch.dtype) else None


def max_position_embeddings(hf_config) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: from the shard index, or every ``*.safetensors``."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except Exception as exc:
            raise ModelLoadError(f"cannot read the shard index {str(index)!r}: {exc}") from exc
        files = sorted({path / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"shard(s) named in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {', '.join(other)}: convert them to safetensors)" if other else ""
        raise ModelLoadError(f"no safetensors weights in {str(path)!r}{hint}")
    return files


def iterate_weights(path: Path, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | CheckpointTensor]]:
    """Every checkpoint tensor, one at a time, memory-mapped from its file.

    ``lazy`` yields :class:`~dovetail.checkpoint_tensor.CheckpointTensor` objects, read
    only in the part the model keeps (tensor parallelism: each rank its slice).
    """
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, CheckpointTensor(f.get_slice(name), name) if lazy else f.get_tensor(name)


def quantization_config(hf_config) -> dict | None:
    value = getattr(hf_config, "quantization_config", None)
    if value is None:
        return None
    return value if isinstance(value, dict) else value.to_dict()


def fill_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights at the real shapes (benchmarks): small uniform values, ones for norms.

    Drawn on the parameters' own device, so an 8B model fills in seconds on a GPU.
    """
    for index, (name, param) in enumerate(model.named_parameters()):
        data = param.data
        gen = torch.Generator(device=data.device).manual_seed(seed + index)
        if data.dtype.is_floating_point and data.element_size() >= 2:
            if data.dim() == 1 and "norm" in name:  # unit scale; a (1 + weight) norm stores 0
                data.fill_(0.0 if getattr(param, "weight_offset", 0.0) else 1.0)
            else:
                data.uniform_(-0.05, 0.05, generator=gen)
        elif data.dtype.is_floating_point:  # 8-bit floats cannot be drawn into directly
            data.copy_(torch.empty(data.shape, device=data.device).uniform_(-0.05, 0.05, generator=gen))
        else:
            info = torch.iinfo(data.dtype)
            data.copy_(torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), data.shape,
                                     generator=gen, device=data.device, dtype=torch.int64).to(data.dtype))


def process_weights_after_loading(model: torch.nn.Module) -> None:
    """Let each layer repack its weights (quantization) or fold constants (norm offsets)."""
    for module in model.modules():
        method = getattr(module, "method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
        elif hasattr(module, "process_weights_after_loading") and module is not model:
            module.process_weights_after_loading()


#: Checkpoint tensors that hold a layer's calibrated FP8 KV-cache scales, as vLLM names them: ``...layers.N.
#: self_attn.k_scale`` and ``.v_scale``, or the older ``.kv_scale`` for both.
KV_SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\..*\b(k_scale|v_scale|kv_scale)$")


def set_kv_cache_scales(model: torch.nn.Module, scales: dict[int, dict[str, float]]) -> int:
    """Give each attention layer its checkpoint scales (``{layer: {"k_scale": s, ...}}``); how many got some."""
    from dovetail.layers.attention import Attention

    count = 0
    for module in model.modules():
        found = scales.get(getattr(module, "layer_index", -1)) if isinstance(module, Attention) else None
        if found:
            both = found.get("kv_scale", 1.0)
            module.impl.k_scale = found.get("k_scale", both)
            module.impl.v_scale = found.get("v_scale", both)
            count += 1
    return count


def load_weights(model, path: Path, adapt: Callable[[Iterator], Iterator] | None = None,
                 optional: tuple[str, ...] = ()) -> None:
    """Fill ``model`` from the checkpoint; any parameter left unfilled is an error naming it.

    ``adapt`` maps the stream of ``(name, tensor)`` pairs before the model sees it, and parameters whose names
    start with one of ``optional`` may stay unfilled (a pooling model: :func:`dovetail.pooling.base_model_weights`,
    and no language-model head).

    Calibrated KV-cache scales (:data:`KV_SCALE_NAME`) go to the attention layers, as vLLM reads them for an
    FP8 KV cache (the largest, where a scale has several elements). With several tensor-parallel ranks the
    model receives lazy tensors, so each rank reads only its shards
    (:meth:`dovetail.model_interface.DovetailModel.load_weights`).
    """
    scales: dict[int, dict[str, float]] = {}

    def weights_but_kv_scales():
        for name, tensor in iterate_weights(path, lazy=tp_size() > 1):
            match = KV_SCALE_NAME.search(name)
            if match:
                scales.setdefault(int(match[1]), {})[match[2]] = float(read(tensor).float().max())
            else:
                yield name, tensor

    weights = weights_but_kv_scales()
    loaded = model.load_weights(adapt(weights) if adapt is not None else weights)
    if scales:
        logger.info("KV-cache scales from the checkpoint for %d attention layers", set_kv_cache_scales(model, scales))
    expected = {name for name, p in model.named_parameters() if not getattr(p, "load_optional", False)
                and not any(name.startswith(prefix) for prefix in optional)}
    missing = sorted(expected - set(loaded))
    if missing:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise ModelLoadError(f"checkpoint in {str(path)!r} is missing tensor(s) for: {shown}")
