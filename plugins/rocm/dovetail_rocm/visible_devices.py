"""Which GPUs a HIP process will see, from ``ROCR_VISIBLE_DEVICES`` and ``HIP_VISIBLE_DEVICES``.

Two filters apply in turn, each with its own rules; both are reproduced here
from the runtimes' sources so that the count is known without starting HIP.

``ROCR_VISIBLE_DEVICES`` (ROCr, ``amd_filter_device``) filters the GPUs in KFD
enumeration order:

- set but empty: no GPU;
- tokens are split at commas, trimmed and upper-cased; at most as many tokens as
  there are GPUs are read;
- a token starting with ``G`` is a UUID or a unique prefix of one
  (``GPU-<16 hex>``, 5 to 20 characters); any other token is an index parsed
  like C ``strtol(token, &end, 0)`` (``0x`` hex, leading-``0`` octal) that must
  use the whole token;
- the first token that is malformed, out of range, ambiguous, matches nothing,
  or repeats an earlier GPU ends the list.

``HIP_VISIBLE_DEVICES`` (HIP, ROCclr ``rocdevice.cpp``), or ``CUDA_VISIBLE_DEVICES``
when it is unset or empty, then indexes what ROCr left:

- empty or unset: no further filtering;
- a token containing ``GPU-`` selects the first GPU whose UUID (lower-case hex)
  contains it;
- otherwise the token must be the canonical decimal form of an index in range;
- the first invalid token ends the list; a repeated GPU is skipped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dovetail_rocm.kfd import KfdGpu

_UUID_PLACEHOLDER = "Invalid-UUID"  # what ROCr compares against for a GPU without a UUID


def _c_strtol_base0(token: str) -> int | None:
    """``strtol(token, &end, 0)`` when it consumes the whole token, else None (``""`` gives 0, as in C)."""
    text = token.lstrip(" \t\n\r\f\v")
    sign = 1
    if text[:1] in "+-" and text:
        sign = -1 if text[0] == "-" else 1
        text = text[1:]
    if not text:
        return 0 if not token.strip() else None
    if text[:2].lower() == "0x" and len(text) > 2:
        digits, allowed, base = text[2:], "0123456789abcdefABCDEF", 16
    elif text[0] == "0":
        digits, allowed, base = text, "01234567", 8
    else:
        digits, allowed, base = text, "0123456789", 10
    if not all(c in allowed for c in digits):
        return None
    return sign * int(digits, base)


def _rocr_uuid_match(token: str, uuids: Sequence[str]) -> int:
    if not 5 <= len(token) <= 20:
        return -1
    found = -1
    for idx, uuid in enumerate(uuids):
        if len(token) <= len(uuid) and uuid.startswith(token):
            if found != -1:
                return -1
            found = idx
    return found


def apply_rocr_visible_devices(gpus: Sequence[KfdGpu], value: str | None) -> list[KfdGpu]:
    """The GPUs ROCr surfaces under ``ROCR_VISIBLE_DEVICES=value`` (``None``: unset), in their new order."""
    if value is None:
        return list(gpus)
    if value == "":
        return []
    uuids = [g.uuid.upper() if g.uuid else _UUID_PLACEHOLDER for g in gpus]
    tokens = [t.strip().upper() for t in value.split(",")]
    if value.endswith(","):
        tokens.pop()  # getline() does not yield an empty token after a trailing comma
    chosen: list[int] = []
    for token in tokens[:len(gpus)]:
        index = _rocr_uuid_match(token, uuids) if token.startswith("G") else _c_strtol_base0(token)
        if index is None or not 0 <= index < len(gpus) or index in chosen:
            break
        chosen.append(index)
    return [gpus[i] for i in chosen]


def apply_hip_visible_devices(gpus: Sequence[KfdGpu], value: str | None) -> list[KfdGpu]:
    """The GPUs HIP keeps of ``gpus`` under ``HIP_VISIBLE_DEVICES=value`` (``None`` or empty: all)."""
    if not value:
        return list(gpus)
    chosen: list[int] = []
    pos = 0
    while pos < len(value):
        end = value.find(",", pos)
        end = len(value) if end == -1 else end
        token = value[pos:end]
        if "GPU-" in token:
            token = next((str(i) for i, g in enumerate(gpus) if token in (g.uuid or "GPU-XX")), token)
        canonical = bool(token) and all(c in "0123456789" for c in token) and str(int(token)) == token
        if not canonical or int(token) >= len(gpus):
            break
        if int(token) not in chosen:
            chosen.append(int(token))
        pos = end + 1
    return [gpus[i] for i in chosen]


def visible_gpus(gpus: Sequence[KfdGpu], env: Mapping[str, str]) -> list[KfdGpu]:
    """The GPUs a HIP process started with ``env`` enumerates, in HIP device order."""
    after_rocr = apply_rocr_visible_devices(gpus, env.get("ROCR_VISIBLE_DEVICES"))
    hip = env.get("HIP_VISIBLE_DEVICES") or env.get("CUDA_VISIBLE_DEVICES")
    return apply_hip_visible_devices(after_rocr, hip)


def describe_filters(env: Mapping[str, str]) -> str:
    """The visibility variables that are set, for messages (empty when none is)."""
    names = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
    return ", ".join(f"{n}={env[n]!r}" for n in names if n in env)
