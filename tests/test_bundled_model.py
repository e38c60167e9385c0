"""The bundled default model: it loads with no ``model`` argument, does arithmetic, and matches HF.

The held-out problems come from the training script's own definition
(``scripts/train_bundled_model.py``), so they are problems the model never saw.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dovetail import LLM, SamplingParams
from dovetail.llm import default_model
from repo_scripts import load_script
from tiny_models import assert_greedy_matches, hf_greedy

ROOT = Path(__file__).resolve().parents[1]
MIN_ACCURACY = 0.95
NUM_HELD_OUT = 100
MAX_BYTES = 10 * 1024 * 1024


train = load_script("scripts/train_bundled_model.py")
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def llm():
    return LLM()


def test_bundled_model_directory_is_small_hf_llama_with_tokenizer():
    path = Path(default_model())
    files = {f.name: f.stat().st_size for f in path.rglob("*") if f.is_file()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    assert sum(files.values()) <= MAX_BYTES, f"bundled model is {sum(files.values())} bytes, over {MAX_BYTES}"
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())


def test_held_out_problems_are_never_trained_on():
    problems = train.held_out_problems(50, seed=7)
    assert len(set(problems)) == 50 and all(train.is_held_out(*p) for p in problems)
    tokenizer = train.build_tokenizer()
    ids, _ = train.training_batch(tokenizer, random.Random(0), 64, 14)
    for row in ids.tolist():
        text = tokenizer.decode(row, skip_special_tokens=True)
        a, op, b, result = re.fullmatch(r"(\d+)([+-])(\d+)=(-?\d+)", text).groups()
        assert not train.is_held_out(int(a), op, int(b))
        assert int(result) == train.answer(int(a), op, int(b))


def test_engine_answers_held_out_problems(llm):
    problems = train.held_out_problems(NUM_HELD_OUT, seed=2024)
    outputs = llm.generate([train.prompt_text(*p) for p in problems], GREEDY, use_tqdm=False)
    wrong = []
    for problem, out in zip(problems, outputs):
        completion = out.outputs[0]
        expected = str(train.answer(*problem))
        if completion.text != expected or completion.finish_reason != "stop":
            wrong.append(f"{train.prompt_text(*problem)}{completion.text!r} (want {expected})")
    accuracy = 1 - len(wrong) / len(problems)
    print(f"bundled model: held-out accuracy {accuracy:.3f} on {len(problems)} problems; wrong: {wrong}")
    assert accuracy >= MIN_ACCURACY, f"accuracy {accuracy:.3f} < {MIN_ACCURACY}; wrong answers: {wrong}"


def test_engine_matches_hf_transformers_token_for_token(llm):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model(), dtype="float32").eval()
    tokenizer = llm.get_tokenizer()
    prompts = ["12+34=", "999+1=", "5-730=", "hello 3+4=\n", "640-75="]
    prompt_ids = [tokenizer(p).input_ids for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    for ids, out in zip(prompt_ids, outputs):
        tokens, logprobs = hf_greedy(hf, ids, 10)
        assert_greedy_matches(out.outputs[0].token_ids, tokens, logprobs)


def test_chat_answers_the_last_question(llm):
    question = [{"role": "user", "content": "12+345="}]
    without_equals = [{"role": "system", "content": "be brief"}, {"role": "user", "content": " 700-12 "}]
    follow_up = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"},
                 {"role": "user", "content": "64-75"}]
    outputs = llm.chat([question, without_equals, follow_up], GREEDY, use_tqdm=False)
    assert [o.outputs[0].text for o in outputs] == ["357", "688", "-11"]


def test_cli_generate_uses_the_bundled_model():
    result = subprocess.run([sys.executable, "-m", "dovetail.cli.main", "--log-level", "WARNING", "generate",
                             "12+34=", "100-250="], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["12+34=46", "100-250=-150"]
