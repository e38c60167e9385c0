"""The README's supported-models table, rendered from the model registrations.

Each row is one registered architecture; its example checkpoints and features
are the ``example_models`` and ``features`` its class declares::

    python -m dovetail_models.table                    # the zoo's table (what the README shows)
    python -m dovetail_models.table --installed        # every installed plugin's models, with the plugin
    python -m dovetail_models.table --update README.md # rewrite the table between the README's markers
    python -m dovetail_models.table --check README.md  # exit 1 when the README's table is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dovetail.registry import Registration, Registry

START = "<!-- models-table:start -->"
END = "<!-- models-table:end -->"
PLUGIN_NAME = "models"


def zoo_registrations() -> list[Registration]:
    """This distribution's registrations, collected through its own ``register_models`` hook."""
    from dovetail_models import plugin

    registry = Registry()
    plugin.register_models(register=lambda **kwargs: registry.add_model(PLUGIN_NAME, **kwargs))
    return [reg for entries in registry.models.values() for reg in entries]


def installed_registrations() -> list[Registration]:
    """Every model registration of the installed plugins, each architecture's winner first."""
    from dovetail.plugin_manager import get_registry

    return [reg for entries in get_registry().models.values() for reg in entries]


def _cell(items, sep: str = "; ") -> str:
    return sep.join(items).replace("|", "\\|") or "-"


def render_table(registrations: list[Registration], show_plugin: bool = False) -> str:
    """A markdown table: architecture, example models, features (and the plugin), sorted by architecture."""
    header = ["Architecture", "Example models", "Features"] + (["Plugin"] if show_plugin else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for reg in sorted(registrations, key=lambda r: (r.name, -r.priority, r.plugin)):
        cls = reg.load()
        row = [f"`{reg.name}`", _cell((f"`{m}`" for m in getattr(cls, "example_models", ())), ", "),
               _cell(getattr(cls, "features", ()))]
        if show_plugin:
            row.append(f"`{reg.plugin}` (`{reg.cls}`, priority {reg.priority})")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def table_in(text: str, source: str = "README.md") -> str:
    """The text between the table markers of ``text``; a clear error when they are missing."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{source} has no models table: add the lines {START} and {END} "
                         "(then run python -m dovetail_models.table --update)")
    return text[start + len(START):end].strip("\n") + "\n"


def replace_table(text: str, table: str, source: str = "README.md") -> str:
    """``text`` with the content between the markers replaced by ``table``."""
    table_in(text, source)
    start, end = text.find(START) + len(START), text.find(END)
    return text[:start] + "\n" + table + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dovetail_models.table", description=__doc__.splitlines()[0])
    parser.add_argument("--installed", action="store_true", help="every installed plugin's models")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--update", metavar="README", help="rewrite the table between the markers of README")
    group.add_argument("--check", metavar="README", help="exit 1 when README's table differs")
    args = parser.parse_args(argv)
    regs = installed_registrations() if args.installed else zoo_registrations()
    table = render_table(regs, show_plugin=args.installed)
    if args.update or args.check:
        path = Path(args.update or args.check)
        text = path.read_text()
        if args.update:
            path.write_text(replace_table(text, table, str(path)))
        elif table_in(text, str(path)) != table:
            print(f"{path}: the models table is stale; run python -m dovetail_models.table --update {path}",
                  file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
