"""Pooling models: the pooling runner's configuration, its per-request parameters, and what becomes of a
pooled state (an embedding, or a classifier's probabilities).

A model runs either to generate text or, with ``runner="pooling"`` (vLLM's name), to pool: each prompt is
run once, its final hidden states are pooled into one vector, and the request finishes without sampling.
``runner="auto"`` picks pooling for checkpoints whose architectures are base models (``Qwen3Model``,
``LlamaModel``: no language-model head) or sequence classifiers (``Qwen3ForSequenceClassification``), which
the zoo runs through the matching ``*ForCausalLM`` class. A base model embeds (task ``embed``); a sequence
classifier applies its ``score`` head to the pooled state (tasks ``classify``, and ``score`` for a
cross-encoder's query-document pairs), in the engine, on the host.

How the hidden states are pooled (``LAST`` token, ``MEAN`` over the prompt, the first token: ``CLS``) and
whether the vector is normalised come from, in order: ``pooler_config``, the checkpoint's
sentence-transformers files (``modules.json`` naming a Pooling and a Normalize module), and vLLM's default
for decoder models, ``LAST`` with normalisation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dovetail.config import format_validation_error
from dovetail.errors import ConfigError, RequestError
from dovetail.sampling_params import RequestParams

RUNNERS = ("auto", "generate", "pooling")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
POOLING_TASKS = ("embed", "classify", "score")
#: Architecture suffixes the pooling runner maps onto the zoo's ``*ForCausalLM`` classes.
_HEADLESS_SUFFIXES = ("ForSequenceClassification", "Model")
#: The checkpoint tensors of a sequence classifier's head (the engine applies it; the model never sees them).
CLASSIFIER_PREFIX = "score."

#: The sentence-transformers modules whose work the pooling runner does.
_ST_MODULES_APPLIED = {"Transformer", "Pooling", "Normalize"}
#: sentence-transformers' Pooling module flags, by the pooling type they mean.
_ST_POOLING_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                     "pooling_mode_cls_token": "CLS"}


class PoolerConfig(BaseModel):
    """How a pooling model turns a prompt's hidden states into its embedding (vLLM's ``--pooler-config``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pooling_type: Optional[Literal[POOLING_TYPES]] = None  # type: ignore[valid-type]
    normalize: Optional[bool] = None


class PoolingParams(RequestParams):
    """Per-request parameters of a pooling request (vLLM's names).

    ``dimensions`` keeps the first ``dimensions`` values (Matryoshka embeddings; only for models whose
    config declares them); ``normalize`` None follows the pooler's setting; ``truncate_prompt_tokens`` keeps
    only the prompt's last ``k`` tokens (-1: as many as ``max_model_len``), so that a long text still pools.
    """

    dimensions: Optional[int] = Field(default=None, ge=1)
    normalize: Optional[bool] = None
    truncate_prompt_tokens: Optional[int] = Field(default=None, ge=-1)
    #: What the request wants of the pooled state (None: the model's own task); set by ``LLM.embed``,
    #: ``LLM.classify``, ``LLM.score`` and the matching endpoints.
    task: Optional[Literal[POOLING_TASKS]] = None  # type: ignore[valid-type]

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _minus_one_or_positive(cls, value):
        if value == 0:
            raise ValueError("must be -1 (the model's maximum) or at least 1")
        return value

    def truncated(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last ``truncate_prompt_tokens`` tokens (all of them when unset)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return prompt_ids
        return prompt_ids[-(max_model_len if keep == -1 else keep):]

    @property
    def n(self) -> int:
        """One result per prompt (the engine's queue limits count sequences)."""
        return 1


def _headless_suffix(arch: str) -> Optional[str]:
    if arch.endswith("PreTrainedModel"):
        return None
    return next((suffix for suffix in _HEADLESS_SUFFIXES if arch.endswith(suffix)), None)


def is_pooling_checkpoint(architectures: list[str]) -> bool:
    """Whether every architecture is a base model (``Qwen3Model``) or a sequence classifier."""
    return bool(architectures) and all(_headless_suffix(a) is not None for a in architectures)


def resolve_runner(requested: str, architectures: list[str]) -> str:
    """``generate`` or ``pooling``: ``auto`` is pooling for base models and sequence classifiers."""
    if requested != "auto":
        return requested
    return "pooling" if is_pooling_checkpoint(architectures) else "generate"


def model_task(architectures: list[str]) -> str:
    """A pooling model's task: ``classify`` for a sequence classifier (it has a ``score`` head), else ``embed``."""
    return "classify" if any(a.endswith("ForSequenceClassification") for a in architectures) else "embed"


def candidate_architectures(architectures: list[str], runner: str) -> list[str]:
    """The architectures to look up in the zoo: a pooling runner also tries ``XForCausalLM`` for ``XModel`` and
    ``XForSequenceClassification`` (the same layers with another head, or none)."""
    if runner != "pooling":
        return list(architectures)
    out = []
    for arch in architectures:
        out.append(arch)
        suffix = _headless_suffix(arch)
        if suffix is not None:
            out.append(arch.removesuffix(suffix) + "ForCausalLM")
    return out


def base_model_weights(weights, prefix: str = "model."):
    """A pooling checkpoint's tensors as the causal-LM class names them: a base model's ``layers.0...`` become
    ``model.layers.0...`` (names that carry the prefix pass unchanged); a classifier's head stays out."""
    for name, tensor in weights:
        if name.startswith(CLASSIFIER_PREFIX):
            continue
        if not name.startswith(prefix) and not name.startswith("lm_head."):
            name = prefix + name
        yield name, tensor


def release_lm_head(model) -> None:
    """Free an untied language-model head's weights (a pooling model never computes logits: for a model of
    151,936 tokens and 4,096 dimensions in bf16 that is 1.2 GB of device memory)."""
    head = getattr(model, "lm_head", None)
    if head is None or getattr(head, "tied", True):
        return
    for param in head.parameters():
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def sentence_transformers_pooler(model_path: str | Path) -> PoolerConfig:
    """The pooling type and normalisation the checkpoint's sentence-transformers files declare (unset when
    it has none)."""
    folder = Path(model_path)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return PoolerConfig()
    try:
        modules = json.loads(modules_file.read_text())
        kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
        pooling_type = None
        if "Pooling" in kinds:
            settings = json.loads((folder / kinds["Pooling"] / "config.json").read_text())
            pooling_type = next((kind for flag, kind in _ST_POOLING_MODES.items() if settings.get(flag)), None)
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise ConfigError(f"pooler_config: the sentence-transformers files in {str(folder)!r} cannot be read: "
                          f"{exc}") from None
    unknown = sorted(set(kinds) - _ST_MODULES_APPLIED)
    if unknown:  # a projection after the pooling would make every vector wrong: refuse rather than guess
        raise ConfigError(f"pooler_config: the checkpoint's sentence-transformers pipeline (modules.json) has "
                          f"{', '.join(unknown)} module(s), which Dovetail does not apply (it applies "
                          f"{', '.join(sorted(_ST_MODULES_APPLIED))})")
    return PoolerConfig(pooling_type=pooling_type, normalize=True if "Normalize" in kinds else None)


def resolve_pooler_config(model_path: str | Path, given: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The pooling type and normalisation as plain values: ``given`` first, then the checkpoint's
    sentence-transformers files, then ``LAST`` with normalisation."""
    try:
        explicit = PoolerConfig(**(given or {}))
    except ValidationError as exc:
        raise ConfigError(f"pooler_config: {format_validation_error(exc)}") from None
    found = sentence_transformers_pooler(model_path)
    return {
        "pooling_type": explicit.pooling_type or found.pooling_type or "LAST",
        "normalize": next(v for v in (explicit.normalize, found.normalize, True) if v is not None),
    }


def pair_texts(text_1, text_2) -> tuple[list[str], list[str]]:
    """A cross-encoder's pairs: one ``text_1`` against every ``text_2``, or the two lists pair by pair."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    for texts, field in ((firsts, "text_1"), (seconds, "text_2")):
        if not texts:
            raise RequestError(f"{field}: no texts", field=field)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise RequestError(f"text_2: {len(seconds)} texts for {len(firsts)} in text_1 (one text_1 for any number, "
                           "or as many as text_2)", field="text_2")
    return firsts, seconds


def matryoshka_dimensions(hf_config) -> Optional[list[int]]:
    """The embedding sizes a Matryoshka model was trained for: its ``matryoshka_dimensions``, or any size
    when it declares ``is_matryoshka``; None when truncation is not supported."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return sorted(int(d) for d in dims)
    if getattr(hf_config, "is_matryoshka", False):
        return []
    return None


def check_dimensions(params: PoolingParams, hf_config, hidden_size: int) -> None:
    """Refuse a ``dimensions`` the model cannot give, naming the field."""
    if params.dimensions is None:
        return
    allowed = matryoshka_dimensions(hf_config)
    if allowed is None:
        raise RequestError("dimensions: this model does not support Matryoshka embeddings (its config sets "
                           "neither is_matryoshka nor matryoshka_dimensions)", field="dimensions")
    if params.dimensions > hidden_size or (allowed and params.dimensions not in allowed):
        sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {hidden_size}"
        raise RequestError(f"dimensions: {params.dimensions} is not among the model's sizes ({sizes})",
                           field="dimensions")


def finish_embedding(pooled: torch.Tensor, params: PoolingParams, normalize_default: bool) -> list[float]:
    """The request's embedding from its pooled hidden state: truncated to ``dimensions``, then normalised
    (L2) unless it says otherwise."""
    vector = pooled.float()
    if params.dimensions is not None:
        vector = vector[:params.dimensions]
    normalize = normalize_default if params.normalize is None else params.normalize
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.tolist()


class ClassifierHead:
    """A sequence classifier's ``score`` head, applied to pooled states in float32 on the host.

    Its probabilities are the sigmoid of the single logit of a one-label model (a cross-encoder's relevance
    score), else the softmax over the labels (vLLM's default activations).
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: list[str]):
        self.weight = weight.float()
        self.bias = None if bias is None else bias.float()
        self.labels = labels

    @classmethod
    def load(cls, model_path: str | Path, hf_config) -> "ClassifierHead":
        """The head from the checkpoint (``score.weight``, ``score.bias`` if any); a ConfigError without one."""
        from safetensors import safe_open

        from dovetail.model_loader import safetensors_files

        found: dict[str, torch.Tensor] = {}
        for file in safetensors_files(Path(model_path)):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name in (CLASSIFIER_PREFIX + "weight", CLASSIFIER_PREFIX + "bias"):
                        found[name.removeprefix(CLASSIFIER_PREFIX)] = f.get_tensor(name)
        weight = found.get("weight")
        hidden = int(hf_config.hidden_size)
        if weight is None or weight.dim() != 2 or weight.shape[1] != hidden:
            shape = "missing" if weight is None else f"shaped {tuple(weight.shape)}"
            raise ConfigError(f"model: a sequence classifier needs its head, score.weight [num_labels, {hidden}], "
                              f"in the checkpoint ({shape})")
        id2label = getattr(hf_config, "id2label", None) or {}
        labels = [str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(weight.shape[0])]
        return cls(weight, found.get("bias"), labels)

    @property
    def num_labels(self) -> int:
        return self.weight.shape[0]

    def probabilities(self, pooled: torch.Tensor) -> list[float]:
        """The labels' probabilities for one pooled state."""
        logits = torch.nn.functional.linear(pooled.float(), self.weight, self.bias)
        probs = torch.sigmoid(logits) if self.num_labels == 1 else torch.softmax(logits, dim=-1)
        return probs.tolist()
