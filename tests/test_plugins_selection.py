"""Selection: flag beats environment beats auto; unknown names list the known; unusable ones say why."""

from __future__ import annotations

import logging

import pytest
import torch

from dovetail import selection
from dovetail.attention.backend import AttentionRequirements
from dovetail.errors import ConfigError, SelectionError
from dovetail.plugin_manager import PluginManager
from fake_plugins import install_fake_plugin

ACCELERATORS = """
from dovetail.hookspecs import hookimpl
from dovetail.platform import ProbeResult
DOVETAIL_PLUGIN_API = ">=1.0"

def probe_absent():
    return ProbeResult.no("no Acme device found (/dev/acme0 missing)")

def probe_present():
    return ProbeResult.ok("1 emulated device")

@hookimpl
def register_platforms(register):
    register(name="acme", cls="dovetail_cpu.platform:CpuPlatform", probe="accel_mod:probe_absent", priority=100)
    {extra}

@hookimpl
def register_attention_backends(register):
    register(name="ACME_ATTN", cls="accel_mod:Only128", platforms=("cpu",), priority=50)

from dovetail.attention.reference import ReferenceBackend

class Only128(ReferenceBackend):
    name = "ACME_ATTN"
    supported_head_sizes = (128,)
"""


def _manager(tmp_path, monkeypatch, extra=""):
    install_fake_plugin(tmp_path, monkeypatch, "accel", "accel_mod", ACCELERATORS.replace("{extra}", extra))
    return PluginManager().load()


def _req(head_size=64, platform="cpu"):
    return AttentionRequirements(platform=platform, device_type="cpu", dtype=torch.float32, kv_cache_dtype="auto",
                                 block_size=16, head_size=head_size, num_heads=4, num_kv_heads=2)


def test_unknown_device_lists_known(tmp_path, monkeypatch):
    manager = _manager(tmp_path, monkeypatch)
    with pytest.raises(SelectionError, match=r"unknown device 'tpu' \(--device\); known: acme, cpu"):
        selection.resolve_platform_name("tpu", manager)


def test_known_but_unusable_device_says_why_and_never_falls_back(tmp_path, monkeypatch):
    manager = _manager(tmp_path, monkeypatch)
    with pytest.raises(SelectionError, match=r"device 'acme' \(--device\) is not usable here: no Acme device found"):
        selection.resolve_platform_name("acme", manager)


def test_auto_skips_unusable_accelerator_and_logs_why(tmp_path, monkeypatch, caplog):
    manager = _manager(tmp_path, monkeypatch)
    selection._logged.clear()
    with caplog.at_level(logging.INFO, logger="dovetail"):
        assert selection.resolve_platform_name(None, manager) == "cpu"
    assert "acme (not usable: no Acme device found" in caplog.text


def test_environment_beats_auto_and_flag_beats_environment(tmp_path, monkeypatch):
    manager = _manager(tmp_path, monkeypatch)
    monkeypatch.setenv("DOVETAIL_DEVICE", "acme")
    with pytest.raises(SelectionError, match=r"device 'acme' \(DOVETAIL_DEVICE\) is not usable"):
        selection.resolve_platform_name(None, manager)
    assert selection.resolve_platform_name("cpu", manager) == "cpu"


def test_two_usable_platforms_with_equal_priority_must_be_chosen(tmp_path, monkeypatch):
    extra = ('register(name="acme2", cls="dovetail_cpu.platform:CpuPlatform", probe="accel_mod:probe_present", '
             'priority=7)\n    register(name="acme3", cls="dovetail_cpu.platform:CpuPlatform", '
             'probe="accel_mod:probe_present", priority=7)')
    manager = _manager(tmp_path, monkeypatch, extra)
    with pytest.raises(SelectionError, match=r"'acme2', 'acme3' are all usable .* choose one with --device"):
        selection.resolve_platform_name(None, manager)


def test_probe_that_raises_is_reported_with_the_plugin(tmp_path, monkeypatch):
    extra = 'register(name="crashy", cls="dovetail_cpu.platform:CpuPlatform", probe="accel_mod:nope")'
    manager = _manager(tmp_path, monkeypatch, extra)
    result = selection.probe_platform("crashy", manager)
    assert not result.usable and "plugin 'accel'" in result.reason and "nope" in result.reason


def test_unknown_backend_lists_known(tmp_path, monkeypatch):
    manager = _manager(tmp_path, monkeypatch)
    platform = selection.create_platform("cpu", manager)
    with pytest.raises(SelectionError, match=r"unknown attention backend 'FLASH' .*known: .*ACME_ATTN.*REFERENCE"):
        selection.select_attention_backend(platform, _req(), "FLASH", manager)


def test_explicit_backend_that_does_not_fit_says_why(tmp_path, monkeypatch):
    manager = _manager(tmp_path, monkeypatch)
    platform = selection.create_platform("cpu", manager)
    with pytest.raises(SelectionError, match=r"head size 64 not supported by ACME_ATTN \(supported: 128\)"):
        selection.select_attention_backend(platform, _req(64), "ACME_ATTN", manager)


def test_backend_for_another_platform_is_refused(tmp_path, monkeypatch):
    manager = _manager(tmp_path, monkeypatch)
    platform = selection.create_platform("cpu", manager)
    with pytest.raises(SelectionError, match=r"'TRITON' .* does not run on device 'cpu' \(it serves: cuda, rocm, xpu\)"):
        selection.select_attention_backend(platform, _req(), "TRITON", manager)


def test_auto_backend_takes_first_valid_and_logs_downgrades(tmp_path, monkeypatch, caplog):
    from dovetail_cpu.platform import CpuPlatform

    class PrefersAcme(CpuPlatform):
        def default_attention_backends(self):
            return ["ACME_ATTN", "REFERENCE"]

    manager = _manager(tmp_path, monkeypatch)
    platform = PrefersAcme()
    selection._logged.clear()
    with caplog.at_level(logging.INFO, logger="dovetail"):
        chosen = selection.select_attention_backend(platform, _req(64), None, manager)
    assert chosen.name != "ACME_ATTN"
    assert "ACME_ATTN (head size 64 not supported by ACME_ATTN" in caplog.text
    assert selection.select_attention_backend(platform, _req(128), None, manager).name == "ACME_ATTN"


def test_backend_environment_variable(tmp_path, monkeypatch):
    manager = _manager(tmp_path, monkeypatch)
    platform = selection.create_platform("cpu", manager)
    monkeypatch.setenv("DOVETAIL_ATTENTION_BACKEND", "REFERENCE")
    assert selection.select_attention_backend(platform, _req(128), None, manager).name == "REFERENCE"
    with pytest.raises(SelectionError, match=r"\(DOVETAIL_ATTENTION_BACKEND\)"):
        monkeypatch.setenv("DOVETAIL_ATTENTION_BACKEND", "ACME_ATTN")
        selection.select_attention_backend(platform, _req(64), None, manager)


def test_unknown_quantization_lists_known():
    manager = PluginManager().load()
    platform = selection.create_platform("cpu", manager)
    with pytest.raises(SelectionError, match=r"unknown quantization method 'int3' \(--quantization\)"):
        selection.select_quant_method(platform, torch.float32, "int3", None, manager)


def test_unknown_architecture_lists_supported():
    manager = PluginManager().load()
    with pytest.raises(SelectionError, match=r"no installed plugin implements architecture\(s\) \['GPT2LMHeadModel'\].*LlamaForCausalLM"):
        selection.select_model_class(["GPT2LMHeadModel"], manager)


def test_engine_refuses_unusable_device_without_falling_back(tiny_llama_dir, tmp_path, monkeypatch):
    from dovetail import LLM

    install_fake_plugin(tmp_path, monkeypatch, "accel", "accel_mod", ACCELERATORS.replace("{extra}", ""))
    with pytest.raises(SelectionError, match="device 'acme' .* not usable"):
        LLM(str(tiny_llama_dir), device="acme")


def test_engine_argument_errors_name_the_field(tiny_llama_dir):
    from dovetail import LLM

    with pytest.raises(ConfigError, match=r"block_size: Input should be greater than or equal to 1 \(got 0\)"):
        LLM(str(tiny_llama_dir), block_size=0)
    with pytest.raises(ConfigError, match=r"unknown engine argument\(s\) 'max_modle_len'"):
        LLM(str(tiny_llama_dir), max_modle_len=10)
