"""Default sampling parameters from the model's ``generation_config.json``, as vLLM takes them.

Model authors put their recommended sampling there (Qwen3: temperature 0.6, top_p 0.95, top_k 20). vLLM applies
those values to every request that does not set them itself (``--generation-config auto``, its default), and so
does Dovetail: ``LLM.generate`` without sampling parameters, and the server's requests field by field.
``--generation-config vllm`` ignores the file (SamplingParams' own defaults), a folder path reads that folder's
file instead, and ``--override-generation-config`` sets values on top.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dovetail.errors import ConfigError, RequestError
from dovetail.sampling_params import SamplingParams

#: The sampling fields taken from a generation config, by their name there, and their SamplingParams name.
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
FILE_NAME = "generation_config.json"


def read_generation_config(folder: str | Path) -> dict[str, Any]:
    """The ``generation_config.json`` of ``folder`` as a dict (empty without one); a file that is not a JSON
    object is a :class:`~dovetail.errors.ConfigError`."""
    path = Path(folder) / FILE_NAME
    if not path.is_file():
        return {}
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"generation_config: cannot read {path}: {exc}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"generation_config: {path} holds no JSON object")
    return values


def default_sampling_values(model_path: str | Path, setting: str = "auto",
                            overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The SamplingParams fields a request that sets none of them gets: from ``generation_config.json`` of
    ``model_path`` (``setting`` "auto"), of the folder ``setting``, or none ("vllm"); then ``overrides`` (a
    generation config's names). A :class:`~dovetail.errors.ConfigError` names a value SamplingParams refuses."""
    found: dict[str, Any] = {}
    source = "generation_config"
    if setting != "vllm":
        folder = Path(model_path) if setting == "auto" else Path(setting)
        if setting != "auto" and not (folder / FILE_NAME).is_file():
            raise ConfigError(f"generation_config: no {FILE_NAME} in {setting} (give auto, vllm or such a folder)")
        found = read_generation_config(folder)
        source = f"generation_config ({folder / FILE_NAME})"
    unknown = sorted(set(overrides or {}) - set(GENERATION_FIELDS))
    if unknown:
        raise ConfigError(f"override_generation_config: {', '.join(unknown)} cannot be set (known: "
                          f"{', '.join(GENERATION_FIELDS)})")
    _check(_pick(found), source)
    return _check(_pick({**found, **(overrides or {})}), "override_generation_config")


def _pick(found: dict[str, Any]) -> dict[str, Any]:
    return {ours: found[theirs] for theirs, ours in GENERATION_FIELDS.items() if found.get(theirs) is not None}


def _check(values: dict[str, Any], source: str) -> dict[str, Any]:
    try:
        SamplingParams(**values)
    except RequestError as exc:
        problem = str(exc).removeprefix("invalid SamplingParams: ")
        if problem.startswith("max_tokens:"):  # named as the generation config names it
            problem = "max_new_tokens:" + problem.removeprefix("max_tokens:")
        raise ConfigError(f"{source}: {problem}") from None
    return values


def describe(values: dict[str, Any]) -> str:
    """``temperature=0.6, top_p=0.95`` for the start-up log."""
    return ", ".join(f"{key}={value}" for key, value in values.items())
