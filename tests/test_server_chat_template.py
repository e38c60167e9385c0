"""``dovetail serve --chat-template``: a file, or the template itself, in place of the tokenizer's; checked when
the server starts. A model whose tokenizer has no template answers chat requests only with one."""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from dovetail.chat_template import load_chat_template
from dovetail.errors import ConfigError
from test_server_cli import API_KEY, ServerProcess, _engine_was_built, _serve, auth

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
FLAGS = ("--api-key", API_KEY, "--served-model-name", "tiny", "--max-model-len", "256")


@pytest.fixture(scope="module")
def untemplated_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with a tokenizer that has no chat template."""
    path = tmp_path_factory.mktemp("no-template") / "model"
    shutil.copytree(tiny_llama_dir, path)
    (path / "chat_template.jinja").unlink()
    assert AutoTokenizer.from_pretrained(str(path)).chat_template is None
    return path


def test_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    assert load_chat_template(None) is None
    tags = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% break %}{% endfor %}"
    assert load_chat_template(tags) == tags, "the tags transformers' templates may use parse"


@pytest.mark.parametrize("text, message", [
    (None, "--chat-template: no file 'chat.jinja', and with no '{{' or '{%' in it, it is no template either"),
    ("{% for m in messages %}{{ m.content }}", "--chat-template FILE: line 1: Unexpected end of template"),
    ("{% for m in messages %}\n{{ m.content }\n{% endfor %}", "--chat-template FILE: line 2: unexpected '}'"),
    ("  \n", "--chat-template FILE: the template is empty"),
])
def test_a_bad_template_is_named_with_its_line(tmp_path, text, message):
    path = tmp_path / "chat.jinja"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_chat_template(str(path) if text is not None else "chat.jinja")
    assert str(caught.value).startswith(message.replace("FILE", str(path))), str(caught.value)


def test_a_broken_template_stops_the_server_before_the_model_loads(untemplated_dir):
    done = _serve(str(untemplated_dir), "--chat-template", "{% if add_generation_prompt %}[assistant]")
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if not line.startswith("INFO")]
    assert len(errors) == 1 and errors[0].startswith("error: --chat-template: line 1: Unexpected end of template")
    assert "Traceback" not in done.stderr and not _engine_was_built(done.stderr)


def test_without_a_template_chat_is_a_400_naming_the_flag(untemplated_dir):
    server = ServerProcess(untemplated_dir, *FLAGS)
    try:
        reply = httpx.post(server.url("/v1/chat/completions"), headers=auth(),
                           json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2})
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["param"] == "messages" and "--chat-template" in error["message"]
        completion = httpx.post(server.url("/v1/completions"), headers=auth(),
                                json={"model": "tiny", "prompt": "hello", "max_tokens": 2})
        assert completion.status_code == 200, "completions need no template"
    finally:
        server.stop()


def test_the_given_template_renders_chat_and_tokenize(untemplated_dir, tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    server = ServerProcess(untemplated_dir, *FLAGS, "--chat-template", str(path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(untemplated_dir))
        expected = tokenizer("[system] be brief\n[user] hello world\n[assistant] ", add_special_tokens=False)
        tokens = httpx.post(server.url("/tokenize"), headers=auth(), json={"model": "tiny", "messages": MESSAGES})
        assert tokens.status_code == 200 and tokens.json()["tokens"] == expected["input_ids"]
        client = openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0)
        assert reply.usage.prompt_tokens == len(expected["input_ids"])
        assert reply.usage.completion_tokens == 3 and reply.choices[0].message.role == "assistant"
    finally:
        server.stop()
