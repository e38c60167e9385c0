"""The supported-models table: rendered from the registrations, and the README kept current."""

from __future__ import annotations

from pathlib import Path

import pytest

from dovetail_models import table
from dovetail_models.plugin import ARCHITECTURES

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_registered_architecture_has_a_row_with_examples_and_features():
    regs = table.zoo_registrations()
    assert sorted(r.name for r in regs) == sorted(ARCHITECTURES)
    rendered = table.render_table(regs)
    rows = rendered.strip().splitlines()[2:]
    assert len(rows) == len(ARCHITECTURES)
    for reg in regs:
        cls = reg.load()
        assert cls.example_models and cls.features, f"{reg.cls} must declare example_models and features"
        row = next(r for r in rows if r.startswith(f"| `{reg.name}` |"))
        assert all(f"`{m}`" in row for m in cls.example_models) and all(f in row for f in cls.features)


def test_readme_holds_the_current_table():
    text = README.read_text() if README.is_file() else ""
    expected = table.render_table(table.zoo_registrations())
    assert table.table_in(text, str(README)) == expected, (
        "README.md's models table is stale: run python -m dovetail_models.table --update README.md")


def test_update_rewrites_only_between_the_markers_and_check_notices_staleness(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\nbefore\n{table.START}\n| old | table |\n{table.END}\nafter\n")
    assert table.main(["--check", str(readme)]) == 1
    assert "stale" in capsys.readouterr().err
    assert table.main(["--update", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# Title\n\nbefore\n") and text.endswith(f"{table.END}\nafter\n")
    assert table.table_in(text) == table.render_table(table.zoo_registrations())
    assert table.main(["--check", str(readme)]) == 0


def test_missing_markers_are_named():
    with pytest.raises(ValueError, match="has no models table: add the lines <!-- models-table:start -->"):
        table.table_in("# no table here\n")
