"""Matching a linear layer against the module lists of a ``quantization_config``.

Checkpoints name modules as HF does (``model.layers.0.self_attn.q_proj``);
Dovetail merges some of them (``qkv_proj``, ``gate_up_proj``). A merged layer
matches a list when every checkpoint module it merges does; when only some do,
the layer cannot be built and that is an error naming them.
"""

from __future__ import annotations

import re
from typing import Iterable

from dovetail.errors import ModelLoadError


def checkpoint_modules(prefix: str) -> list[str]:
    """The checkpoint module names a Dovetail layer ``prefix`` loads from (itself when it merges none)."""
    from dovetail.layers.weights import DEFAULT_STACKED

    dotted = prefix + "."
    names = [dotted.replace(param_part, ckpt_part)[:-1]
             for param_part, ckpt_part, _ in DEFAULT_STACKED if param_part in dotted]
    return names or [prefix]


def name_matches(name: str, pattern: str) -> bool:
    """HF's rule (``should_convert_module``) plus compressed-tensors' ``re:`` prefix.

    ``re:REGEX`` matches from the start of ``name``; a plain pattern matches the
    whole name, a suffix of it (``lm_head``, ``mlp.down_proj``), or a prefix
    ending at a module boundary (``model.layers.0`` covers ``model.layers.0.mlp``),
    read as a regular expression as HF does.
    """
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if name == pattern or name.endswith("." + pattern) or name.endswith(pattern):
        return True
    try:
        return re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", name) is not None
    except re.error:
        return False


def layer_matches(prefix: str, patterns: Iterable[str] | None, what: str) -> bool:
    """Whether layer ``prefix`` is named by ``patterns`` (``what`` names the list in errors)."""
    patterns = list(patterns or [])
    if not patterns:
        return False
    names = checkpoint_modules(prefix)
    hits = [any(name_matches(n, p) for p in patterns) for n in names]
    if all(hits):
        return True
    if any(hits):
        listed = [n for n, h in zip(names, hits) if h]
        unlisted = [n for n, h in zip(names, hits) if not h]
        raise ModelLoadError(f"quantization_config.{what} names {', '.join(listed)} but not "
                             f"{', '.join(unlisted)}; Dovetail merges them into one layer ({prefix}), "
                             "so they must be quantized alike")
    return False
