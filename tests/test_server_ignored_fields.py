"""Request fields the server does not define are ignored, never silently: each name is logged once."""

from __future__ import annotations

import time

import httpx
import pytest

from test_server_cli import MAIN_FLAGS, auth, shared_server


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    return shared_server(tiny_llama_dir, *MAIN_FLAGS)


def test_each_unknown_field_is_logged_once_and_the_request_still_runs(server):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "x_unknown_alpha": 1, "x_unknown_beta": {"a": 1}}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "x_unknown_alpha": True, "stream_options_x": 3}
    for _ in range(3):
        response = httpx.post(server.url("/v1/completions"), json=body, headers=auth(), timeout=120)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
    assert httpx.post(server.url("/v1/chat/completions"), json=chat, headers=auth(), timeout=120).status_code == 200
    deadline = time.monotonic() + 10
    while "stream_options_x" not in server.output() and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = [line for line in server.output().splitlines() if "is ignored" in line]
    assert sum("'x_unknown_alpha'" in line and "CompletionRequest" in line and "Chat" not in line
               for line in lines) == 1
    assert sum("'x_unknown_beta'" in line for line in lines) == 1
    assert sum("'x_unknown_alpha'" in line and "ChatCompletionRequest" in line for line in lines) == 1
    assert sum("'stream_options_x'" in line for line in lines) == 1
    assert not any("'max_tokens'" in line or "'prompt'" in line for line in lines)
