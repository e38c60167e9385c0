"""Default sampling from the model's ``generation_config.json`` (vLLM's ``--generation-config auto``): what a
request gets for a field it does not set, offline and over the server; ``vllm`` and overrides; bad values named."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx
import openai
import pytest

from dovetail import LLM, SamplingParams
from dovetail.errors import ConfigError
from dovetail.generation_defaults import default_sampling_values
from test_server_cli import API_KEY, ServerProcess, auth

#: top_k 1 makes sampling greedy whatever the temperature, so the default is visible in the tokens.
MODEL_DEFAULTS = {"temperature": 0.9, "top_k": 1, "max_new_tokens": 5, "do_sample": True, "eos_token_id": 2}
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 40))]
COMMON = {"max_model_len": 128, "num_gpu_blocks_override": 64}


def _write(folder, values) -> None:
    (folder / "generation_config.json").write_text(json.dumps(values))


@pytest.fixture(scope="module")
def recommending_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama whose generation config recommends sampling."""
    path = tmp_path_factory.mktemp("recommends") / "model"
    shutil.copytree(tiny_llama_dir, path)
    _write(path, MODEL_DEFAULTS)
    return path


def test_the_fields_taken_and_their_names(tmp_path):
    _write(tmp_path, {**MODEL_DEFAULTS, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1, "top_k": None})
    expected = {"temperature": 0.9, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1, "max_tokens": 5}
    assert default_sampling_values(tmp_path) == expected
    assert default_sampling_values("/nonexistent", setting=str(tmp_path)) == expected, "a folder's file"
    assert default_sampling_values(tmp_path, setting="vllm") == {}
    assert default_sampling_values(tmp_path / "absent") == {}, "no file: SamplingParams' defaults"
    assert default_sampling_values(tmp_path, overrides={"temperature": 0.2, "max_new_tokens": 9}) == \
        {**expected, "temperature": 0.2, "max_tokens": 9}
    assert default_sampling_values(tmp_path, setting="vllm", overrides={"top_k": 3}) == {"top_k": 3}


@pytest.mark.parametrize("file_values, setting, overrides, message", [
    ({"top_p": 1.5}, "auto", None, "generation_config (DIR/generation_config.json): top_p: "),
    ({"max_new_tokens": 0}, "auto", None, "generation_config (DIR/generation_config.json): max_new_tokens: "),
    ({}, "auto", {"temperature": -1}, "override_generation_config: temperature: "),
    ({}, "auto", {"num_beams": 4}, "override_generation_config: num_beams cannot be set (known: temperature, "),
    (None, "auto", None, "generation_config: cannot read "),
    ({}, "missing-folder", None, "generation_config: no generation_config.json in missing-folder"),
])
def test_bad_values_are_named(tmp_path, file_values, setting, overrides, message):
    if file_values is None:
        (tmp_path / "generation_config.json").write_text("{not json")
    else:
        _write(tmp_path, file_values)
    with pytest.raises(ConfigError) as caught:
        default_sampling_values(tmp_path, setting=setting, overrides=overrides)
    assert str(caught.value).startswith(message.replace("DIR", str(tmp_path))), str(caught.value)


def test_generate_without_parameters_samples_as_the_model_recommends(recommending_dir):
    llm = LLM(str(recommending_dir), **COMMON)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.9, top_k=1, max_tokens=5)
    greedy = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)]
    defaulted = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)]
    assert defaulted == greedy and all(len(tokens) == 5 for tokens in defaulted)


def test_vllm_and_overrides_offline(recommending_dir):
    plain = LLM(str(recommending_dir), generation_config="vllm", **COMMON)
    assert plain.get_default_sampling_params() == SamplingParams()
    overridden = LLM(str(recommending_dir), override_generation_config={"max_new_tokens": 3, "top_k": 2}, **COMMON)
    assert overridden.get_default_sampling_params() == SamplingParams(temperature=0.9, top_k=2, max_tokens=3)


def test_a_bad_override_flag_is_named():
    done = subprocess.run([sys.executable, "-m", "dovetail.cli.main", "serve", "--override-generation-config",
                           "[1]"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--override-generation-config: expected a JSON object" in done.stderr


def test_the_server_fills_the_fields_a_request_leaves_out(recommending_dir):
    server = ServerProcess(recommending_dir, "--api-key", API_KEY, "--served-model-name", "tiny",
                           "--max-model-len", "128")
    try:
        def complete(**fields):
            reply = httpx.post(server.url("/v1/completions"), headers=auth(),
                               json={"model": "tiny", "prompt": PROMPTS[1], **fields})
            assert reply.status_code == 200, reply.text
            return reply.json()

        greedy = complete(temperature=0, max_tokens=5)
        defaulted = complete()
        assert defaulted["usage"]["completion_tokens"] == 5, "max_new_tokens is the default max_tokens"
        assert defaulted["choices"][0]["text"] == greedy["choices"][0]["text"], "top_k 1: greedy at temperature 0.9"
        own = [complete(top_k=-1, temperature=1.5, seed=seed, max_tokens=5)["choices"][0]["text"] for seed in (1, 2)]
        assert own != [greedy["choices"][0]["text"]] * 2, "a request's own top_k comes first"
        client = openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0)
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert chat.usage.completion_tokens == 5
    finally:
        server.stop()
