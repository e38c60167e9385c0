"""What plugins registered: platforms, attention backends, quantization methods, models.

Registrations are plain records naming their implementation lazily; nothing here
imports a plugin's implementation until :meth:`Registration.load` is called.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field

from dovetail.errors import PluginError
from dovetail.lazy_import import resolve


@dataclass
class Registration:
    """One registered implementation, named lazily by ``cls`` ("module:Class")."""

    kind: str
    name: str
    cls: str
    plugin: str
    priority: int = 0

    def load(self):
        """Import and return the implementation; a failure names the plugin."""
        try:
            return resolve(self.cls)
        except Exception as exc:
            raise PluginError(
                f"plugin {self.plugin!r} registered {self.kind} {self.name!r} as {self.cls!r}, "
                f"which failed to import: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            ) from exc


@dataclass
class PlatformRegistration(Registration):
    """A platform: its probe says cheaply whether it is usable here."""

    probe: str | None = None


@dataclass
class AttentionBackendRegistration(Registration):
    """An attention backend and the platform names it serves (``"*"``: all)."""

    platforms: tuple[str, ...] = ("*",)

    def serves(self, platform_name: str) -> bool:
        return "*" in self.platforms or platform_name in self.platforms


@dataclass
class Registry:
    """Every registration collected from the loaded plugins, by kind and name."""

    platforms: dict[str, PlatformRegistration] = field(default_factory=dict)
    attention_backends: dict[str, AttentionBackendRegistration] = field(default_factory=dict)
    quantization_methods: dict[str, Registration] = field(default_factory=dict)
    # An architecture may be registered by several plugins; all are kept, best first.
    models: dict[str, list[Registration]] = field(default_factory=dict)

    def add_platform(self, plugin: str, name: str, cls: str, probe: str | None = None, priority: int = 0):
        _check_names(plugin, "platform", name, cls)
        self._no_clash(self.platforms, "platform", name, plugin)
        reg = self.platforms[name] = PlatformRegistration(
            kind="platform", name=name, cls=cls, plugin=plugin, priority=int(priority), probe=probe
        )
        return reg

    def add_attention_backend(self, plugin: str, name: str, cls: str, platforms=("*",), priority: int = 0):
        _check_names(plugin, "attention backend", name, cls)
        if isinstance(platforms, str):
            platforms = (platforms,)
        self._no_clash(self.attention_backends, "attention backend", name, plugin)
        reg = self.attention_backends[name] = AttentionBackendRegistration(
            kind="attention backend", name=name, cls=cls, plugin=plugin,
            priority=int(priority), platforms=tuple(platforms),
        )
        return reg

    def add_quantization_method(self, plugin: str, name: str, cls: str):
        _check_names(plugin, "quantization method", name, cls)
        self._no_clash(self.quantization_methods, "quantization method", name, plugin)
        reg = self.quantization_methods[name] = Registration(
            kind="quantization method", name=name, cls=cls, plugin=plugin
        )
        return reg

    def add_model(self, plugin: str, architecture: str, cls: str, priority: int = 0):
        _check_names(plugin, "model", architecture, cls)
        entries = self.models.setdefault(architecture, [])
        reg = Registration(kind="model", name=architecture, cls=cls, plugin=plugin, priority=int(priority))
        entries.append(reg)
        entries.sort(key=lambda r: -r.priority)
        return reg

    def remove(self, reg: Registration) -> None:
        """Withdraw one registration (its plugin failed part-way through registering)."""
        for table in (self.platforms, self.attention_backends, self.quantization_methods):
            if table.get(reg.name) is reg:
                del table[reg.name]
        entries = self.models.get(reg.name, [])
        if reg in entries:
            entries.remove(reg)

    def model(self, architecture: str) -> Registration | None:
        """The registration that wins for ``architecture``: the highest priority.

        Two registrations tied at the top are an error naming both plugins.
        """
        entries = self.models.get(architecture)
        if not entries:
            return None
        if len(entries) > 1 and entries[1].priority == entries[0].priority:
            raise PluginError(
                f"architecture {architecture!r} is registered with the same priority "
                f"{entries[0].priority} by plugins {entries[0].plugin!r} and {entries[1].plugin!r}; "
                "the replacement must use a higher priority, or block one plugin"
            )
        return entries[0]

    @staticmethod
    def _no_clash(table: dict, kind: str, name: str, plugin: str):
        if name in table:
            raise PluginError(
                f"{kind} {name!r} is registered twice: by plugin {table[name].plugin!r} and by "
                f"plugin {plugin!r}; block one of them with DOVETAIL_BLOCK_PLUGINS"
            )


def _check_names(plugin: str, kind: str, name: str, cls: str):
    if not isinstance(name, str) or not name:
        raise PluginError(f"plugin {plugin!r} registered a {kind} without a name")
    if not isinstance(cls, str) or ":" not in cls:
        raise PluginError(
            f"plugin {plugin!r} registered {kind} {name!r} with cls={cls!r}; "
            "it must be a lazy 'module:Class' string"
        )
