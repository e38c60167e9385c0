"""``tokenizer=`` / ``--tokenizer``: the tokenizer comes from its own directory when the model's has none."""

from __future__ import annotations

import shutil

import pytest

from dovetail import LLM, SamplingParams
from dovetail.errors import ModelLoadError, RequestError
from dovetail.model_loader import TOKENIZER_FILES


@pytest.fixture(scope="module")
def split_dirs(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama's weights and config without a tokenizer, and its tokenizer files alone elsewhere."""
    root = tmp_path_factory.mktemp("split")
    model, tokenizer = root / "model", root / "tokenizer"
    model.mkdir()
    tokenizer.mkdir()
    for path in tiny_llama_dir.iterdir():
        is_tokenizer = path.name in TOKENIZER_FILES or path.name.startswith(("special_tokens", "vocab", "merges"))
        shutil.copy(path, (tokenizer if is_tokenizer else model) / path.name)
    assert not any((model / name).exists() for name in TOKENIZER_FILES)
    return model, tokenizer


def test_the_tokenizer_argument_is_the_tokenizer_the_engine_uses(tiny_llama_dir, split_dirs):
    model, tokenizer = split_dirs
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM(str(tiny_llama_dir), device="cpu").generate(["hello world"], params, use_tqdm=False)[0]
    llm = LLM(str(model), tokenizer=str(tokenizer), device="cpu")
    got = llm.generate(["hello world"], params, use_tqdm=False)[0]
    assert llm.llm_engine.tokenizer_path == tokenizer
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.outputs[0].token_ids == want.outputs[0].token_ids and got.outputs[0].text == want.outputs[0].text


def test_without_the_argument_a_model_without_a_tokenizer_takes_only_token_ids(split_dirs):
    model, _ = split_dirs
    llm = LLM(str(model), device="cpu")
    assert llm.llm_engine.tokenizer is None
    with pytest.raises(RequestError, match="no tokenizer"):
        llm.generate(["hello world"], SamplingParams(max_tokens=2), use_tqdm=False)


def test_a_tokenizer_directory_without_a_tokenizer_is_refused_by_name(split_dirs, tmp_path):
    model, _ = split_dirs
    with pytest.raises(ModelLoadError, match=r"^tokenizer: .* holds no tokenizer"):
        LLM(str(model), tokenizer=str(tmp_path), device="cpu")
    with pytest.raises(ModelLoadError, match=r"^tokenizer: .* is not a directory"):
        LLM(str(model), tokenizer=str(tmp_path / "missing"), device="cpu")


def test_the_generate_command_takes_tokenizer(split_dirs, capsys):
    from dovetail.cli.main import main

    model, tokenizer = split_dirs
    assert main(["--log-level", "WARNING", "generate", "hello world", "--model", str(model), "--tokenizer",
                 str(tokenizer), "--device", "cpu", "--max-tokens", "3", "--temperature", "0", "--json"]) == 0
    assert "hello world" in capsys.readouterr().out
    assert main(["--log-level", "WARNING", "generate", "hello world", "--model", str(model), "--device", "cpu",
                 "--max-tokens", "3"]) == 2  # no tokenizer for a text prompt: one clear line, exit 2
