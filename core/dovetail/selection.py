"""Choosing the platform, attention backend, quantization method and model class.

Explicit first, probed second, never silent: an argument or flag beats the
environment (``DOVETAIL_DEVICE``, ``DOVETAIL_ATTENTION_BACKEND``), which beats
auto-selection. An unknown name lists the known ones, an unusable one says why,
and auto-selection logs its choice and every candidate it passed over, once.
"""

from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass

import torch

from dovetail.attention.backend import AttentionBackend, AttentionRequirements
from dovetail.errors import PluginError, SelectionError
from dovetail.lazy_import import resolve
from dovetail.platform import Platform, ProbeResult
from dovetail.plugin_manager import PluginManager, get_plugin_manager
from dovetail.quantization.base import QuantMethod

logger = logging.getLogger("dovetail")
_logged: set[str] = set()


def log_once(message: str, *args) -> None:
    text = message % args if args else message
    if text not in _logged:
        _logged.add(text)
        logger.info(text)


def _unknown(kind: str, name: str, known, manager: PluginManager, flag: str) -> SelectionError:
    listing = ", ".join(sorted(known)) or "none"
    text = f"unknown {kind} {name!r} ({flag}); known: {listing}"
    report = manager.failure_report()
    return SelectionError(f"{text}\n{report}" if report else text)


# -- platforms ---------------------------------------------------------------------------


def probe_platform(name: str, manager: PluginManager | None = None) -> ProbeResult:
    """Run a registered platform's cheap probe; a probe that raises is reported, not hidden."""
    manager = manager or get_plugin_manager()
    reg = manager.registry.platforms[name]
    try:
        probe = resolve(reg.probe) if reg.probe else reg.load().probe
        result = probe()
    except PluginError as exc:
        return ProbeResult.no(str(exc))
    except Exception as exc:
        message = (f"the probe of platform {name!r} from plugin {reg.plugin!r} raised "
                   f"{type(exc).__name__}: {exc}")
        logger.warning("%s\n%s", message, traceback.format_exc())
        return ProbeResult.no(message)
    if not isinstance(result, ProbeResult):
        return ProbeResult.no(f"the probe of platform {name!r} from plugin {reg.plugin!r} returned "
                              f"{result!r} instead of a ProbeResult")
    return result


def resolve_platform_name(requested: str | None = None, manager: PluginManager | None = None) -> str:
    """The platform to use: ``requested``, else ``DOVETAIL_DEVICE``, else the best usable one."""
    manager = manager or get_plugin_manager()
    platforms = manager.registry.platforms
    source = "--device" if requested else "DOVETAIL_DEVICE"
    requested = requested or os.environ.get("DOVETAIL_DEVICE") or None
    if requested and requested != "auto":
        if requested not in platforms:
            raise _unknown("device", requested, platforms, manager, source)
        result = probe_platform(requested, manager)
        if not result.usable:
            raise SelectionError(f"device {requested!r} ({source}) is not usable here: {result.reason}")
        log_once("device %r chosen by %s", requested, source)
        return requested
    usable, rejected = [], []
    for name, reg in platforms.items():
        result = probe_platform(name, manager)
        (usable if result.usable else rejected).append((reg.priority, name, result.reason))
    if not usable:
        reasons = "; ".join(f"{n}: {r}" for _, n, r in rejected) or "no platform is installed"
        report = manager.failure_report()
        raise SelectionError(f"no usable device found ({reasons}). Install a platform plugin, e.g. "
                             f"dovetail-cpu.{chr(10) + report if report else ''}")
    usable.sort(key=lambda item: -item[0])
    if len(usable) > 1 and usable[0][0] == usable[1][0]:
        tied = [n for p, n, _ in usable if p == usable[0][0]]
        raise SelectionError(f"devices {', '.join(map(repr, tied))} are all usable with the same priority; "
                             "choose one with --device (or DOVETAIL_DEVICE)")
    chosen = usable[0][1]
    passed = "; ".join(f"{n} (not usable: {r})" for _, n, r in rejected)
    log_once("device %r chosen automatically (highest priority usable)%s", chosen,
             f"; passed over {passed}" if passed else "")
    return chosen


#: The platform created last for each torch device type: what the core's kernels ask about that device.
_DEVICE_PLATFORMS: dict[str, Platform] = {}


def create_platform(name: str, manager: PluginManager | None = None) -> Platform:
    """An instance of the registered platform ``name``; it answers, from now on, the kernels' questions about
    tensors on its device type (:func:`platform_for_device`)."""
    manager = manager or get_plugin_manager()
    cls = manager.registry.platforms[name].load()
    platform = cls()
    _DEVICE_PLATFORMS[platform.device_type] = platform
    return platform


def platform_for_device(device_type: str, manager: PluginManager | None = None) -> Platform | None:
    """The platform that answers questions about tensors on ``device_type`` (the core's Triton kernels ask it
    whether to launch with PDL and how many multiprocessors a device has): the one created last for that
    device type, else the usable platform of highest priority that computes on it, else None."""
    if device_type not in _DEVICE_PLATFORMS:
        manager = manager or get_plugin_manager()
        for name, reg in sorted(manager.registry.platforms.items(), key=lambda item: -item[1].priority):
            try:
                computes_here = reg.load().device_type == device_type
            except Exception:
                continue
            if computes_here and probe_platform(name, manager).usable:
                create_platform(name, manager)
                break
    return _DEVICE_PLATFORMS.get(device_type)


# -- attention backends -------------------------------------------------------------------


def attention_backend_candidates(platform: Platform, manager: PluginManager | None = None) -> list[str]:
    """Installed backends serving ``platform``, in the order auto-selection tries them.

    The platform's own preferences first, then other backends serving it by
    priority; backends with a negative priority (fallbacks such as REFERENCE) last.
    """
    manager = manager or get_plugin_manager()
    backends = manager.registry.attention_backends
    preferred = [n for n in platform.default_attention_backends()
                 if n in backends and backends[n].serves(platform.name)]
    others = sorted((r for n, r in backends.items() if n not in preferred and r.serves(platform.name)),
                    key=lambda r: -r.priority)
    order = preferred + [r.name for r in others]
    return [n for n in order if backends[n].priority >= 0] + [n for n in order if backends[n].priority < 0]


def select_attention_backend(platform: Platform, req: AttentionRequirements, requested: str | None = None,
                             manager: PluginManager | None = None) -> type[AttentionBackend]:
    """The attention backend class for ``req`` on ``platform``."""
    manager = manager or get_plugin_manager()
    backends = manager.registry.attention_backends
    source = "--attention-backend" if requested else "DOVETAIL_ATTENTION_BACKEND"
    requested = requested or os.environ.get("DOVETAIL_ATTENTION_BACKEND") or None
    if requested and requested.lower() != "auto":
        if requested not in backends:
            raise _unknown("attention backend", requested, backends, manager, source)
        reg = backends[requested]
        if not reg.serves(platform.name):
            raise SelectionError(f"attention backend {requested!r} ({source}) does not run on device "
                                 f"{platform.name!r} (it serves: {', '.join(reg.platforms)})")
        cls = reg.load()
        reasons = cls.validate(req)
        if reasons:
            raise SelectionError(f"attention backend {requested!r} ({source}) cannot run this model: "
                                 + "; ".join(reasons))
        log_once("attention backend %r chosen by %s", requested, source)
        return cls
    passed = []
    for name in attention_backend_candidates(platform, manager):
        try:
            cls = backends[name].load()
        except PluginError as exc:
            passed.append(f"{name} (failed to import: {str(exc).splitlines()[0]})")
            continue
        reasons = cls.validate(req)
        if reasons:
            passed.append(f"{name} ({'; '.join(reasons)})")
            continue
        log_once("attention backend %r chosen automatically for device %r%s", name, platform.name,
                 f"; passed over {', '.join(passed)}" if passed else "")
        return cls
    raise SelectionError(f"no attention backend can run this model on device {platform.name!r}: "
                         + (", ".join(passed) or "none is installed"))


# -- quantization ---------------------------------------------------------------------------


def select_quant_method(platform: Platform, dtype: torch.dtype, requested: str | None,
                        checkpoint_config: dict | None, manager: PluginManager | None = None) -> QuantMethod:
    """The quantization method: the flag, else the checkpoint's ``quant_method``, else none."""
    manager = manager or get_plugin_manager()
    methods = manager.registry.quantization_methods
    from_checkpoint = (checkpoint_config or {}).get("quant_method")
    if requested and from_checkpoint and requested != from_checkpoint:
        raise SelectionError(f"--quantization {requested!r} conflicts with the checkpoint, which is "
                             f"quantized with {from_checkpoint!r} (quantization_config.quant_method)")
    name = requested or from_checkpoint or "none"
    if name not in methods:
        source = "--quantization" if requested else "the checkpoint's quantization_config.quant_method"
        raise _unknown("quantization method", name, [m for m in methods if m != "none"], manager, source)
    cls = methods[name].load()
    method = cls.from_config(checkpoint_config if from_checkpoint else None)
    reasons = method.validate(platform, dtype)
    if reasons:
        raise SelectionError(f"quantization {name!r} cannot run here: " + "; ".join(reasons))
    if name != "none":
        log_once("quantization %r (%s)", name, "from the checkpoint" if from_checkpoint else "from --quantization")
    return method


# -- models -----------------------------------------------------------------------------------


@dataclass
class ModelChoice:
    """The model class chosen for a checkpoint's architecture, and the plugin (and its path) that registered it."""

    architecture: str
    cls: type
    plugin: str
    path: str


def select_model_class(architectures: list[str], manager: PluginManager | None = None) -> ModelChoice:
    """The implementation of the first of the checkpoint's architectures that is registered."""
    manager = manager or get_plugin_manager()
    for arch in architectures or []:
        reg = manager.registry.model(arch)
        if reg is not None:
            cls = reg.load()
            log_once("architecture %r implemented by %s from plugin %r", arch, reg.cls, reg.plugin)
            return ModelChoice(arch, cls, reg.plugin, reg.cls)
    known = sorted(manager.registry.models)
    text = (f"no installed plugin implements architecture(s) {architectures!r} (config.json 'architectures'); "
            f"supported: {', '.join(known) or 'none -- install dovetail-models'}")
    report = manager.failure_report()
    raise SelectionError(f"{text}\n{report}" if report else text)
