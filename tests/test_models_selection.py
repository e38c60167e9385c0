"""What the zoo tells selection: attention shapes, backends refusing features, out-of-tree replacements."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from dovetail import LLM, SamplingParams, selection
from dovetail.errors import PluginError, SelectionError
from dovetail.plugin_manager import PluginManager, get_registry
from fake_plugins import install_fake_plugin

BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def _config(name: str, **overrides):
    import transformers

    config = getattr(transformers, name)(**{**BASE, **overrides})
    config.architectures = [name.replace("TextConfig", "ForCausalLM").replace("Config", "ForCausalLM")]
    return config


def _shape(config):
    from dovetail_models.plugin import ARCHITECTURES
    from dovetail.lazy_import import resolve

    return resolve(ARCHITECTURES[config.architectures[0]]).attention_shape(config)


def test_gemma2_reports_soft_capping_and_sliding_windows():
    shape = _shape(_config("Gemma2Config", head_dim=32, attn_logit_softcapping=50.0, sliding_window=16))
    assert (shape.num_heads, shape.num_kv_heads, shape.head_size) == (4, 2, 32)
    assert shape.uses_logit_softcap and shape.uses_sliding_window
    plain = _shape(_config("Gemma2Config", attn_logit_softcapping=None, layer_types=["full_attention"] * 4))
    assert not plain.uses_logit_softcap and not plain.uses_sliding_window


def test_gemma3_never_soft_caps_attention_like_hf():
    config = _config("Gemma3TextConfig", attn_logit_softcapping=50.0, sliding_window=16, sliding_window_pattern=2)
    shape = _shape(config)
    assert shape.uses_sliding_window and not shape.uses_logit_softcap


@pytest.mark.parametrize("name,overrides,window", [
    ("MistralConfig", dict(sliding_window=16), True),
    ("MistralConfig", dict(sliding_window=None), False),
    ("Qwen2Config", dict(use_sliding_window=False, sliding_window=16), False),
    ("Qwen2Config", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2), True),
    ("Qwen3Config", dict(head_dim=24), False),
    ("LlamaConfig", dict(), False),
])
def test_sliding_window_and_head_size_follow_the_config(name, overrides, window):
    shape = _shape(_config(name, **overrides))
    assert shape.uses_sliding_window is window
    assert shape.head_size == overrides.get("head_dim", 16) and not shape.uses_logit_softcap


LIMITED_BACKENDS = """
from dovetail.attention.reference import ReferenceBackend
from dovetail.hookspecs import hookimpl

DOVETAIL_PLUGIN_API = ">=1.0,<2"


class NoSoftcapBackend(ReferenceBackend):
    name = "NOSOFTCAP"
    supports_logit_softcap = False


class NoWindowBackend(ReferenceBackend):
    name = "NOWINDOW"
    supports_sliding_window = False


@hookimpl
def register_attention_backends(register):
    register(name="NOSOFTCAP", cls="limited_backends:NoSoftcapBackend", platforms=("*",), priority=-200)
    register(name="NOWINDOW", cls="limited_backends:NoWindowBackend", platforms=("*",), priority=-200)
"""


@pytest.fixture
def limited_backends(tmp_path, monkeypatch):
    install_fake_plugin(tmp_path / "site", monkeypatch, "limited", "limited_backends", LIMITED_BACKENDS)


def _config_dir(tmp_path, config):
    config.save_pretrained(str(tmp_path / "model"))
    return str(tmp_path / "model")


@pytest.mark.parametrize("backend,name,overrides,reason", [
    ("NOSOFTCAP", "Gemma2Config", dict(head_dim=16, attn_logit_softcapping=50.0),
     "logit soft-capping not supported by NOSOFTCAP"),
    ("NOWINDOW", "MistralConfig", dict(sliding_window=16), "sliding-window attention not supported by NOWINDOW"),
    ("NOWINDOW", "Gemma3TextConfig", dict(head_dim=16, sliding_window=16, sliding_window_pattern=2),
     "sliding-window attention not supported by NOWINDOW"),
])
def test_backend_without_a_feature_the_model_needs_is_refused_with_the_reason(
        limited_backends, tmp_path, backend, name, overrides, reason):
    path = _config_dir(tmp_path, _config(name, **overrides))
    with pytest.raises(SelectionError, match=rf"attention backend '{backend}' .*cannot run this model: .*{reason}"):
        LLM(path, attention_backend=backend, num_gpu_blocks_override=16)


def test_the_same_limited_backend_runs_a_model_without_the_feature(limited_backends, tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), attention_backend="NOSOFTCAP", num_gpu_blocks_override=64, max_model_len=128)
    assert llm.llm_engine.attention_backend.name == "NOSOFTCAP"
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


REPLACEMENT = """
from dovetail.hookspecs import hookimpl
from dovetail_models.llama import LlamaForCausalLM

DOVETAIL_PLUGIN_API = ">=1.0,<2"


class ReplacementLlama(LlamaForCausalLM):
    '''A vendor's own Llama (here the zoo's, subclassed, counting its forward passes).'''

    calls = 0

    def forward(self, input_ids, positions):
        ReplacementLlama.calls += 1
        return super().forward(input_ids, positions)


@hookimpl
def register_models(register):
    register(architecture="LlamaForCausalLM", cls="zoo_replacement:ReplacementLlama", priority=PRIORITY)
    register(architecture="BrandNewForCausalLM", cls="zoo_replacement:ReplacementLlama")
"""


def _install_replacement(tmp_path, monkeypatch, priority: int):
    install_fake_plugin(tmp_path / "site", monkeypatch, "vendorzoo", "zoo_replacement",
                        REPLACEMENT.replace("PRIORITY", str(priority)))


def test_out_of_tree_plugin_replaces_a_builtin_architecture_and_the_log_names_it(
        tmp_path, monkeypatch, caplog, tiny_llama_dir):
    _install_replacement(tmp_path, monkeypatch, priority=10)
    monkeypatch.setattr(selection, "_logged", set())
    caplog.set_level(logging.INFO, logger="dovetail")
    llm = LLM(str(tiny_llama_dir), attention_backend="REFERENCE", num_gpu_blocks_override=64, max_model_len=128)
    model = llm.llm_engine.model
    assert type(model).__name__ == "ReplacementLlama" and llm.llm_engine.model_choice.plugin == "vendorzoo"
    assert ("architecture 'LlamaForCausalLM' implemented by zoo_replacement:ReplacementLlama from plugin "
            "'vendorzoo'") in caplog.text
    llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2), use_tqdm=False)
    assert type(model).calls > 0
    entries = get_registry().models["LlamaForCausalLM"]
    assert [e.plugin for e in entries] == ["vendorzoo", "models"], "the built-in stays registered, ranked second"


def test_without_a_replacement_the_log_names_the_builtin(monkeypatch, caplog, tiny_llama_dir):
    monkeypatch.setattr(selection, "_logged", set())
    caplog.set_level(logging.INFO, logger="dovetail")
    LLM(str(tiny_llama_dir), attention_backend="REFERENCE", num_gpu_blocks_override=64, max_model_len=128)
    assert ("architecture 'LlamaForCausalLM' implemented by dovetail_models.llama:LlamaForCausalLM from plugin "
            "'models'") in caplog.text


def test_out_of_tree_plugin_adds_an_architecture(tmp_path, monkeypatch, tiny_llama_dir):
    _install_replacement(tmp_path, monkeypatch, priority=10)
    model_dir = tmp_path / "brand-new"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["BrandNewForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    llm = LLM(str(model_dir), attention_backend="REFERENCE", num_gpu_blocks_override=64, max_model_len=128)
    assert llm.llm_engine.model_choice.architecture == "BrandNewForCausalLM"
    assert type(llm.llm_engine.model).__name__ == "ReplacementLlama"


def test_a_replacement_at_the_builtin_priority_is_an_error_naming_both_plugins(tmp_path, monkeypatch):
    _install_replacement(tmp_path, monkeypatch, priority=0)
    manager = PluginManager().load()
    with pytest.raises(PluginError, match=r"'LlamaForCausalLM'.*same priority 0 by plugins '(models|vendorzoo)' "
                                          r"and '(models|vendorzoo)'"):
        selection.select_model_class(["LlamaForCausalLM"], manager)


def test_phi3_longrope_is_refused_naming_the_field(tmp_path):
    factors = [1.0] * 8
    config = _config("Phi3Config", pad_token_id=0, eos_token_id=1, original_max_position_embeddings=64,
                     rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=factors,
                                          long_factor=factors))
    with pytest.raises(ValueError, match=r"rope_parameters.rope_type 'longrope' \(config.json\) is not supported"):
        LLM(_config_dir(tmp_path, config), attention_backend="REFERENCE", num_gpu_blocks_override=16)
