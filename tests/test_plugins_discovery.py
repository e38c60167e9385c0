"""Plugin discovery: entry points, version ranges, failures reported by name, allow/block lists."""

from __future__ import annotations

import logging

import pytest

from dovetail.errors import SelectionError
from dovetail.plugin_manager import PluginManager
from dovetail import selection
from fake_plugins import install_fake_plugin

GOOD = """
from dovetail.hookspecs import hookimpl
DOVETAIL_PLUGIN_API = ">=1.0,<2"

@hookimpl
def register_attention_backends(register):
    register(name="FAKE_ATTN", cls="dovetail.attention.reference:ReferenceBackend", platforms=("cpu",))
"""


def test_entry_point_plugin_is_loaded_and_registers(tmp_path, monkeypatch):
    install_fake_plugin(tmp_path, monkeypatch, "goodplug", "goodplug_mod", GOOD)
    manager = PluginManager().load()
    assert manager.plugins["goodplug"].loaded
    assert manager.plugins["goodplug"].distribution == "fake-goodplug"
    assert manager.registry.attention_backends["FAKE_ATTN"].plugin == "goodplug"


def test_core_builtins_are_registered_through_the_hooks():
    manager = PluginManager().load()
    assert manager.registry.attention_backends["REFERENCE"].plugin == "core"
    assert "none" in manager.registry.quantization_methods


def test_contract_version_mismatch_names_plugin_range_and_core(tmp_path, monkeypatch):
    install_fake_plugin(tmp_path, monkeypatch, "oldplug", "oldplug_mod",
                        GOOD.replace('">=1.0,<2"', '">=2.0,<3"'))
    manager = PluginManager().load()
    error = manager.plugins["oldplug"].error
    assert "oldplug" in error and ">=2.0,<3" in error and "1.0" in error
    assert "FAKE_ATTN" not in manager.registry.attention_backends


def test_missing_contract_declaration_is_an_error(tmp_path, monkeypatch):
    install_fake_plugin(tmp_path, monkeypatch, "undeclared", "undeclared_mod",
                        GOOD.replace('DOVETAIL_PLUGIN_API = ">=1.0,<2"', ""))
    manager = PluginManager().load()
    assert "does not declare DOVETAIL_PLUGIN_API" in manager.plugins["undeclared"].error


def test_import_failure_is_a_warning_with_name_and_traceback(tmp_path, monkeypatch, caplog):
    install_fake_plugin(tmp_path, monkeypatch, "brokenplug", "brokenplug_mod",
                        "import definitely_not_a_module_xyz\n")
    with caplog.at_level(logging.WARNING, logger="dovetail"):
        manager = PluginManager().load()
    assert "brokenplug" in caplog.text and "definitely_not_a_module_xyz" in caplog.text
    assert "Traceback" in manager.plugins["brokenplug"].error
    # Other plugins still work: the CPU platform is still selectable.
    assert selection.resolve_platform_name("cpu", manager) == "cpu"


def test_import_failure_is_fatal_when_what_it_may_provide_is_asked_for(tmp_path, monkeypatch):
    install_fake_plugin(tmp_path, monkeypatch, "acmeplug", "acmeplug_mod", "raise RuntimeError('acme driver missing')\n")
    manager = PluginManager().load()
    with pytest.raises(SelectionError) as info:
        selection.resolve_platform_name("acme", manager)
    text = str(info.value)
    assert "unknown device 'acme'" in text and "acmeplug" in text and "acme driver missing" in text


def test_misspelled_hook_is_an_error(tmp_path, monkeypatch):
    install_fake_plugin(tmp_path, monkeypatch, "typoplug", "typoplug_mod", """
        from dovetail.hookspecs import hookimpl
        DOVETAIL_PLUGIN_API = ">=1.0"

        @hookimpl
        def register_platform(register):
            pass
    """)
    manager = PluginManager().load()
    assert "register_platform" in manager.plugins["typoplug"].error
    assert "does not define" in manager.plugins["typoplug"].error


def test_registration_that_raises_withdraws_the_plugin(tmp_path, monkeypatch):
    install_fake_plugin(tmp_path, monkeypatch, "halfplug", "halfplug_mod", """
        from dovetail.hookspecs import hookimpl
        DOVETAIL_PLUGIN_API = ">=1.0"

        @hookimpl
        def register_attention_backends(register):
            register(name="HALF", cls="dovetail.attention.reference:ReferenceBackend")
            raise ValueError("second registration broke")
    """)
    manager = PluginManager().load()
    assert "second registration broke" in manager.plugins["halfplug"].error
    assert "HALF" not in manager.registry.attention_backends


def test_lazy_path_must_be_a_string(tmp_path, monkeypatch):
    install_fake_plugin(tmp_path, monkeypatch, "eagerplug", "eagerplug_mod", """
        from dovetail.hookspecs import hookimpl
        from dovetail.attention.reference import ReferenceBackend
        DOVETAIL_PLUGIN_API = ">=1.0"

        @hookimpl
        def register_attention_backends(register):
            register(name="EAGER", cls=ReferenceBackend)
    """)
    manager = PluginManager().load()
    assert "lazy 'module:Class' string" in manager.plugins["eagerplug"].error


def test_allow_list_and_block_list(tmp_path, monkeypatch):
    install_fake_plugin(tmp_path, monkeypatch, "goodplug", "goodplug_mod", GOOD)
    monkeypatch.setenv("DOVETAIL_PLUGINS", "cpu")
    manager = PluginManager().load()
    assert "goodplug" not in manager.plugins and "models" not in manager.plugins and "cpu" in manager.plugins
    assert "core" in manager.plugins
    monkeypatch.delenv("DOVETAIL_PLUGINS")
    monkeypatch.setenv("DOVETAIL_BLOCK_PLUGINS", "goodplug")
    manager = PluginManager().load()
    assert "goodplug" not in manager.plugins and "cpu" in manager.plugins


def test_duplicate_name_across_plugins_is_reported(tmp_path, monkeypatch):
    install_fake_plugin(tmp_path, monkeypatch, "dupplug", "dupplug_mod", """
        from dovetail.hookspecs import hookimpl
        DOVETAIL_PLUGIN_API = ">=1.0"

        @hookimpl
        def register_attention_backends(register):
            register(name="REFERENCE", cls="dovetail.attention.reference:ReferenceBackend")
    """)
    manager = PluginManager().load()
    error = manager.plugins["dupplug"].error
    assert "registered twice" in error and "'core'" in error and "'dupplug'" in error
