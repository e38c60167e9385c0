"""``dovetail plugins``: what is installed, what each plugin registers, and what is usable here."""

from __future__ import annotations

import argparse
import json

from dovetail.errors import DovetailError


def add_parser(sub) -> None:
    p = sub.add_parser("plugins", help="list installed plugins, what they register and what is usable here")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="say how an engine of this many ranks would run here (default 1)")
    p.add_argument("--distributed-executor-backend", default=None, choices=("uni", "mp", "ray"))
    p.set_defaults(func=run)


def parallelism(platform, tensor_parallel_size: int = 1, requested: str | None = None) -> dict:
    """The world size and the executor an engine of ``tensor_parallel_size`` ranks gets here, and what
    each executor needs."""
    from importlib import metadata

    from dovetail.executor import executor_backend

    executor = executor_backend(tensor_parallel_size, requested)
    try:
        ray = f"installed ({metadata.version('ray')})"
    except metadata.PackageNotFoundError:
        ray = "not installed (pip install 'dovetail[ray]')"
    info = {"world_size": tensor_parallel_size, "executor": executor,
            "executors": {"uni": "one rank in the engine's process", "mp": "a process per device on this host",
                          "ray": f"Ray actors, across machines: {ray}"}}
    if platform is not None:
        info.update(devices=platform.device_count(), dist_backend=platform.dist_backend)
        if executor == "mp":
            try:
                platform.check_world_size(tensor_parallel_size)
            except DovetailError as exc:
                info["error"] = str(exc)
    return info


def collect(tensor_parallel_size: int = 1, executor: str | None = None) -> dict:
    """Everything ``dovetail plugins`` reports, as plain data."""
    import torch

    from dovetail import selection
    from dovetail.plugin_manager import get_plugin_manager

    manager = get_plugin_manager()
    registry = manager.registry
    platforms = {}
    for name, reg in registry.platforms.items():
        probe = selection.probe_platform(name, manager)
        entry = {"plugin": reg.plugin, "class": reg.cls, "priority": reg.priority, "usable": probe.usable,
                 "reason": probe.reason}
        try:
            entry["verification"] = reg.load().verification
        except DovetailError as exc:
            entry["usable"], entry["reason"] = False, str(exc).splitlines()[0]
        platforms[name] = entry
    usable_platforms = [n for n, e in platforms.items() if e["usable"]]
    backends = {}
    for name, reg in registry.attention_backends.items():
        entry = {"plugin": reg.plugin, "class": reg.cls, "platforms": list(reg.platforms)}
        try:
            cls = reg.load()
            missing = cls.available()
            serves = [p for p in usable_platforms if reg.serves(p)]
            entry.update(capabilities=cls.capabilities(), verification=cls.verification,
                         usable=not missing and bool(serves),
                         reason=missing or ("" if serves else "serves no usable platform here"))
        except DovetailError as exc:
            entry.update(usable=False, reason=str(exc).splitlines()[0])
        backends[name] = entry
    auto: dict = {}
    try:
        chosen = selection.resolve_platform_name(None, manager)
        platform = selection.create_platform(chosen, manager)
        auto["device"] = chosen
        order = selection.attention_backend_candidates(platform, manager)
        auto["attention_backends_in_order"] = order
        auto["order_reason"] = platform.attention_backend_order_reason()
        auto["attention_backend"] = next((b for b in order if backends.get(b, {}).get("usable")), None)
        dtype = platform.supported_dtypes()[0]
    except DovetailError as exc:
        auto["error"] = str(exc)
        platform, dtype = None, torch.float32
    methods = {}
    for name, reg in registry.quantization_methods.items():
        entry = {"plugin": reg.plugin, "class": reg.cls}
        try:
            cls = reg.load()
            entry["platforms"] = list(cls.supported_platforms)
            reasons = cls.from_config(None).validate(platform, dtype) if platform else ["no usable device"]
            entry.update(usable=not reasons, reason="; ".join(reasons))
        except Exception as exc:  # a method's constructor may need a checkpoint config
            entry.update(usable=None, reason=f"{type(exc).__name__}: {exc}".splitlines()[0])
        methods[name] = entry
    models = {arch: [{"plugin": r.plugin, "class": r.cls, "priority": r.priority} for r in regs]
              for arch, regs in registry.models.items()}
    plugins = [{"name": p.name, "distribution": p.distribution, "version": p.version, "module": p.module,
                "api_range": p.api_range, "loaded": p.loaded, "error": p.error,
                "registers": [f"{r.kind} {r.name}" for r in p.registrations]}
               for p in manager.plugins.values()]
    return {"plugins": plugins, "platforms": platforms, "attention_backends": backends,
            "quantization_methods": methods, "models": models, "auto_selection": auto,
            "parallelism": parallelism(platform, tensor_parallel_size, executor)}


def _yes_no(value) -> str:
    return "yes" if value else ("?" if value is None else "no")


def render(data: dict) -> str:
    lines = ["Plugins:"]
    for p in data["plugins"]:
        status = "loaded" if p["loaded"] else f"FAILED: {p['error'].strip().splitlines()[-1]}"
        lines.append(f"  {p['name']:<10} {p['distribution'] or '?'} {p['version'] or ''}  [{status}]")
        if p["registers"]:
            lines.append(f"             registers: {', '.join(p['registers'])}")
    lines.append("\nPlatforms (--device):")
    for name, e in data["platforms"].items():
        why = f" -- {e['reason']}" if e["reason"] else ""
        lines.append(f"  {name:<10} usable: {_yes_no(e['usable'])}{why}  (plugin {e['plugin']}, priority {e['priority']})")
        if e.get("verification"):
            lines.append(f"             {e['verification']}")
    lines.append("\nAttention backends (--attention-backend):")
    for name, e in data["attention_backends"].items():
        why = f" -- {e['reason']}" if e.get("reason") else ""
        lines.append(f"  {name:<12} usable here: {_yes_no(e.get('usable'))}{why}  "
                     f"(plugin {e['plugin']}; platforms {', '.join(e['platforms'])})")
        if e.get("verification"):
            lines.append(f"               {e['verification']}")
    lines.append("\nQuantization methods (--quantization):")
    for name, e in data["quantization_methods"].items():
        why = f" -- {e['reason']}" if e.get("reason") else ""
        lines.append(f"  {name:<8} usable here: {_yes_no(e.get('usable'))}{why}  (plugin {e['plugin']})")
    lines.append("\nModel architectures:")
    for arch, regs in sorted(data["models"].items()):
        winner = regs[0]
        extra = f" (replaces {', '.join(r['plugin'] for r in regs[1:])})" if len(regs) > 1 else ""
        lines.append(f"  {arch:<28} plugin {winner['plugin']}{extra}")
    auto = data["auto_selection"]
    lines.append("\nAuto-selection here:")
    if "error" in auto:
        lines.append(f"  {auto['error']}")
    else:
        lines.append(f"  device: {auto['device']}; attention backend: {auto['attention_backend']} "
                     f"(tried in order: {', '.join(auto['attention_backends_in_order'])})")
        if auto.get("order_reason"):
            lines.append(f"  why this order: {auto['order_reason']}")
    par = data["parallelism"]
    devices = f"; {par['devices']} device(s) visible, collectives over {par['dist_backend']}" if "devices" in par else ""
    lines.append(f"  parallelism: world size {par['world_size']}, executor {par['executor']}{devices}")
    if "error" in par:
        lines.append(f"  {par['error']}")
    lines.append("  executors (--distributed-executor-backend): "
                 + "; ".join(f"{name}: {what}" for name, what in par["executors"].items()))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from dovetail.config import EngineArgs

    EngineArgs("m", tensor_parallel_size=args.tensor_parallel_size,
               distributed_executor_backend=args.distributed_executor_backend).create_engine_config()
    data = collect(args.tensor_parallel_size, args.distributed_executor_backend)
    print(json.dumps(data, indent=2, default=str) if args.json else render(data))
    return 0
