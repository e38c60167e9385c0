"""The out-of-tree vendor example (examples/vendor_plugin) is listed, selected and generates text.

It is installed into the test environment by the README's test command; nothing in
the core names it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dovetail import LLM, SamplingParams
from tiny_models import assert_greedy_matches, hf_greedy, save_model, tiny_llama_config


def _plugins_json(env=None) -> dict:
    import os

    result = subprocess.run([sys.executable, "-m", "dovetail.cli.main", "--log-level", "ERROR", "plugins", "--json"],
                            capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def acme_model_dir(tmp_path_factory):
    path = save_model(tmp_path_factory.mktemp("acme"), tiny_llama_config())
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["AcmeForCausalLM"]  # Acme's own name for a Llama-shaped checkpoint
    (path / "config.json").write_text(json.dumps(config))
    return path


def _hf_llama(path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(path)).eval()


def test_dovetail_plugins_lists_the_vendor_plugin():
    data = _plugins_json()
    acme = next(p for p in data["plugins"] if p["name"] == "acme")
    assert acme["distribution"] == "acme-dovetail" and acme["loaded"]
    assert {"platform toy", "attention backend TOY_ATTN", "quantization method toy_int8",
            "model AcmeForCausalLM"} <= set(acme["registers"])
    assert data["platforms"]["toy"]["usable"] is True
    assert data["attention_backends"]["TOY_ATTN"]["usable"] is True
    assert data["auto_selection"]["device"] == "cpu", "the toy device ranks below the CPU"


def test_unusable_vendor_device_is_reported_with_its_reason():
    data = _plugins_json({"DOVETAIL_TOY_PRESENT": "0"})
    assert data["platforms"]["toy"]["usable"] is False
    assert "DOVETAIL_TOY_PRESENT=0" in data["platforms"]["toy"]["reason"]


def test_device_flag_selects_the_vendor_platform_and_backend(acme_model_dir):
    llm = LLM(str(acme_model_dir), device="toy")
    engine = llm.llm_engine
    assert engine.platform.name == "toy" and engine.attention_backend.name == "TOY_ATTN"
    assert engine.model_choice.plugin == "acme"
    prompt = list(range(7, 30))
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    tokens, logprobs = hf_greedy(_hf_llama(acme_model_dir), prompt, 12)
    assert_greedy_matches(out.outputs[0].token_ids, tokens, logprobs)
    text = llm.generate(["hello world"], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(text.outputs[0].token_ids) == 5 and isinstance(text.outputs[0].text, str)


def test_vendor_quantization_method_through_the_flag(acme_model_dir):
    llm = LLM(str(acme_model_dir), device="toy", quantization="toy_int8")
    layer = llm.llm_engine.model.layers[0].qkv_proj
    assert layer.weight.dtype.is_floating_point is False and layer.method.name == "toy_int8"
    prompt = list(range(7, 30))
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    reference, _ = hf_greedy(_hf_llama(acme_model_dir), prompt, 8)
    assert out.outputs[0].token_ids[:3] == reference[:3], "int8 weights should keep the first greedy tokens"


def test_vendor_quantization_refused_where_it_cannot_run(acme_model_dir):
    import torch

    from dovetail import selection
    from dovetail.errors import SelectionError
    from dovetail_cpu.platform import CpuPlatform

    # toy_int8 takes float32 activations only. Asked for bfloat16 on the CPU, the engine stops at the dtype
    # where the CPU lacks bfloat16 (AVX2) and at the quantization method where it has it; the method's own
    # refusal is checked directly so that it is proven on every CPU.
    with pytest.raises(SelectionError, match=r"toy_int8.*activation dtype bfloat16"):
        selection.select_quant_method(CpuPlatform(), torch.bfloat16, "toy_int8", None)
    if torch.bfloat16 in CpuPlatform().supported_dtypes():
        with pytest.raises(SelectionError, match=r"toy_int8.*activation dtype bfloat16"):
            LLM(str(acme_model_dir), quantization="toy_int8", dtype="bfloat16")
    else:
        from dovetail.errors import ConfigError

        with pytest.raises(ConfigError, match=r"dtype: bfloat16 is not supported on device 'cpu'"):
            LLM(str(acme_model_dir), quantization="toy_int8", dtype="bfloat16")
