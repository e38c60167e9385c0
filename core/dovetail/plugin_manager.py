"""Discovers plugins through entry points and collects their registrations.

Plugins are the entry points of group ``dovetail`` (read with importlib-metadata)
plus the core's own built-ins, registered through the same hooks. Environment:

- ``DOVETAIL_PLUGINS``: comma-separated allow-list of entry-point names; only
  these are loaded (the core's built-ins always are).
- ``DOVETAIL_BLOCK_PLUGINS``: comma-separated entry-point names never loaded.

A plugin that fails (import error, unsupported contract version, misspelled hook,
a registration that raises) is recorded with its name and traceback and logged
as a warning; asking for something that only a failed plugin could provide
is then an error that carries that report (see :mod:`dovetail.selection`).
"""

from __future__ import annotations

import importlib
import logging
import os
import traceback
from dataclasses import dataclass, field

import importlib_metadata
import pluggy
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

import dovetail
from dovetail import hookspecs
from dovetail.registry import Registry

logger = logging.getLogger("dovetail")

ENTRY_POINT_GROUP = hookspecs.PROJECT_NAME
CORE_PLUGIN_NAME = "core"
CORE_PLUGIN_MODULE = "dovetail.builtin_plugin"


@dataclass
class PluginInfo:
    """One plugin: where it comes from, and whether it loaded."""

    name: str
    module: str
    distribution: str | None = None
    version: str | None = None
    api_range: str | None = None
    error: str | None = None
    registrations: list = field(default_factory=list)

    @property
    def loaded(self) -> bool:
        return self.error is None


def _env_list(var: str) -> list[str] | None:
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        return None
    return [item.strip() for item in raw.split(",") if item.strip()]


class PluginManager:
    """Loads the plugins once and holds what they registered."""

    def __init__(self, allow: list[str] | None = None, block: list[str] | None = None):
        self.allow = allow if allow is not None else _env_list("DOVETAIL_PLUGINS")
        self.block = set(block if block is not None else (_env_list("DOVETAIL_BLOCK_PLUGINS") or []))
        self.registry = Registry()
        self.plugins: dict[str, PluginInfo] = {}
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs.DovetailHookSpecs)

    # -- loading ---------------------------------------------------------------------

    def load(self) -> "PluginManager":
        core = PluginInfo(name=CORE_PLUGIN_NAME, module=CORE_PLUGIN_MODULE, distribution="dovetail",
                          version=dovetail.__version__)
        self._load_one(core, lambda: importlib.import_module(CORE_PLUGIN_MODULE))
        for ep in self._entry_points():
            dist = getattr(ep, "dist", None)
            info = PluginInfo(
                name=ep.name, module=ep.value,
                distribution=dist.metadata["Name"] if dist is not None else None,
                version=dist.version if dist is not None else None,
            )
            if ep.name in self.plugins:
                info.error = (f"plugin name {ep.name!r} is used by two entry points "
                              f"({self.plugins[ep.name].module!r} and {ep.value!r}); the second was skipped")
                logger.warning(info.error)
                continue
            self._load_one(info, ep.load)
        return self

    def _entry_points(self):
        eps = sorted(importlib_metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
        for ep in eps:
            if ep.name == CORE_PLUGIN_NAME:
                continue
            if ep.name in self.block:
                logger.info("plugin %r not loaded: blocked by DOVETAIL_BLOCK_PLUGINS", ep.name)
                continue
            if self.allow is not None and ep.name not in self.allow:
                logger.info("plugin %r not loaded: not in DOVETAIL_PLUGINS=%s", ep.name, ",".join(self.allow))
                continue
            yield ep

    def _load_one(self, info: PluginInfo, importer):
        self.plugins[info.name] = info
        try:
            module = importer()
        except Exception:
            return self._fail(info, f"failed to import {info.module!r}:\n{traceback.format_exc()}")
        info.api_range = getattr(module, "DOVETAIL_PLUGIN_API", None)
        problem = check_api_range(info.name, info.api_range)
        if problem:
            return self._fail(info, problem)
        try:
            self._pm.register(module, name=info.name)
        except Exception as exc:
            return self._fail(info, f"could not be registered with pluggy: {exc}")
        try:
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            self._pm.unregister(module)
            return self._fail(info, f"implements a hook the contract does not define: {exc}")
        self._collect(info, module)

    def _collect(self, info: PluginInfo, module):
        """Call this plugin's registration hooks, recording what it registers."""
        adders = {
            "register_platforms": self.registry.add_platform,
            "register_attention_backends": self.registry.add_attention_backend,
            "register_quantization_methods": self.registry.add_quantization_method,
            "register_models": self.registry.add_model,
        }
        others = [p for p in self._pm.get_plugins() if p is not module]
        for hook_name, add in adders.items():

            def register(*args, _add=add, **kwargs):
                registration = _add(info.name, *args, **kwargs)
                info.registrations.append(registration)

            try:
                self._pm.subset_hook_caller(hook_name, remove_plugins=others)(register=register)
            except Exception:
                for registration in info.registrations:
                    self.registry.remove(registration)
                info.registrations.clear()
                self._fail(info, f"raised in {hook_name}:\n{traceback.format_exc()}")
                return

    def _fail(self, info: PluginInfo, reason: str):
        info.error = reason
        logger.warning("dovetail plugin %r (%s) failed and is not used: %s",
                       info.name, info.distribution or info.module, reason)

    # -- queries ---------------------------------------------------------------------

    def failed_plugins(self) -> list[PluginInfo]:
        return [p for p in self.plugins.values() if not p.loaded]

    def failure_report(self) -> str:
        """Text naming every failed plugin and why; empty when none failed."""
        failed = self.failed_plugins()
        if not failed:
            return ""
        lines = ["These plugins failed to load, and may provide it:"]
        for p in failed:
            lines.append(f"- plugin {p.name!r} ({p.distribution or p.module}): {p.error}")
        return "\n".join(lines)


def check_api_range(plugin_name: str, api_range) -> str | None:
    """The reason a plugin's declared contract range excludes this core, or None."""
    core = dovetail.PLUGIN_API_VERSION
    if api_range is None:
        return (f"plugin {plugin_name!r} does not declare DOVETAIL_PLUGIN_API (the range of plugin "
                f"contract versions it supports); this core implements version {core}")
    try:
        spec = SpecifierSet(str(api_range))
    except InvalidSpecifier:
        return f"plugin {plugin_name!r} declares DOVETAIL_PLUGIN_API={api_range!r}, which is not a version range"
    if Version(core) not in spec:
        return (f"plugin {plugin_name!r} supports plugin contract {api_range!r}, but this core "
                f"implements version {core}")
    return None


_MANAGER: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, loaded on first use."""
    global _MANAGER
    if _MANAGER is None:
        _MANAGER = PluginManager().load()
    return _MANAGER


def reset_plugin_manager() -> None:
    """Forget the loaded plugins (tests change DOVETAIL_PLUGINS between cases)."""
    global _MANAGER
    _MANAGER = None


def get_registry() -> Registry:
    return get_plugin_manager().registry

