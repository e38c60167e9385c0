"""No request may stall the server: fan-outs are bounded at the door, long prompts never hold the event loop.

The servers run the bundled model (a character-level tokenizer, max_model_len 256), over real sockets.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

import tokenizer_spy
from test_server_cli import ServerProcess, shared_server

#: The issue's fan-out: 201 bytes of body, 20 prompts x 1,024 samples = 20,480 sequences.
FAN_OUT = {"prompt": ["1+1="] * 20, "n": 1024, "max_tokens": 1}
SMALL = {"prompt": "12+34=", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def bundled_dir():
    from dovetail.llm import default_model

    return default_model()


@pytest.fixture(scope="module")
def server(bundled_dir):
    return shared_server(bundled_dir)


def _post(server, body, path="/v1/completions", **kwargs):
    return httpx.post(server.url(path), json=body, timeout=kwargs.pop("timeout", 300), **kwargs)


def _streamed_text(response) -> str:
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    return "".join(choice["text"] for event in events for choice in event["choices"])


def _metric(server, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(server.url("/metrics")).text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_a_fan_out_is_refused_at_the_door_while_a_small_request_is_answered(server):
    results = {}
    big = threading.Thread(target=lambda: results.update(big=_post(server, FAN_OUT)))
    big.start()
    small = _post(server, SMALL)
    big.join(timeout=600)
    assert small.status_code == 200 and small.json()["choices"][0]["text"] == "46"
    refused = results["big"]
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "n" and "20480 sequences" in error["message"]
    assert "--max-sequences-per-request" in error["message"]


def test_empty_prompt_is_refused(server):
    response = _post(server, {"prompt": "", "max_tokens": 4})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert "empty" in response.json()["error"]["message"]


def test_server_on_loopback_without_a_key_answers_only_loopback_names(server):
    assert httpx.get(server.url("/health"), headers={"Host": f"localhost:{server.port}"}).status_code == 200
    assert httpx.get(server.url("/health"), headers={"Host": f"[::1]:{server.port}"}).status_code == 200
    rebound = httpx.post(server.url("/v1/completions"), json=SMALL, headers={"Host": f"attacker.example:{server.port}"})
    assert rebound.status_code == 400
    error = rebound.json()["error"]
    assert error["code"] == "host_not_allowed" and "--allowed-hosts" in error["message"]


# -- the waiting queue counts sequences; a client that leaves frees them at once ---------------------------------


@pytest.fixture(scope="module")
def wide_server(bundled_dir):
    """Limits raised so that the whole fan-out is taken, and the waiting queue bounded at its size."""
    server = ServerProcess(bundled_dir, "--max-sequences-per-request", "20480", "--max-waiting-requests", "20480")
    yield server
    server.stop(signal.SIGKILL)


def test_waiting_queue_counts_sequences_and_a_client_leaving_aborts_its_own(wide_server):
    server = wide_server
    with httpx.Client(timeout=300) as client:
        with client.stream("POST", server.url("/v1/completions"), json=FAN_OUT | {"stream": True}) as big:
            assert big.status_code == 200  # the headers come once its 20,480 sequences are queued
            again = _post(server, FAN_OUT)
            assert again.status_code == 503, again.text
            assert again.json()["error"]["code"] == "queue_full"
            assert "20480 more asked for" in again.json()["error"]["message"]
        # The big client went away: its sequences are aborted, and the small request is answered.
    small = _post(server, SMALL)
    assert small.status_code == 200 and small.json()["choices"][0]["text"] == "46"
    finished = _metric(server, 'dovetail_finished_sequences_total{finish_reason="length"}')
    assert finished < 20480, "the fan-out ran to its end although its client had left"
    assert _metric(server, 'dovetail_requests_total{outcome="aborted"}') == 1
    assert _metric(server, 'dovetail_requests_total{outcome="overloaded"}') == 1
    assert _metric(server, "dovetail_num_requests_waiting") == 0


# -- tokenising: refused by length first, never on the event loop ------------------------------------------------


@pytest.fixture(scope="module")
def spied(bundled_dir, tmp_path_factory):
    """A server whose tokenizer records each text it gets and holds those containing tokenizer_spy.HOLD."""
    folder = tmp_path_factory.mktemp("tokenizer-spy")
    log, release = folder / "calls.log", folder / "release"
    server = ServerProcess(bundled_dir, preload="tokenizer_spy",
                           env={"DOVETAIL_TEST_TOKENIZER_LOG": str(log), "DOVETAIL_TEST_TOKENIZER_RELEASE": str(release)})
    yield server, log, release
    release.touch()
    server.stop(signal.SIGKILL)


def test_a_prompt_longer_than_the_context_is_refused_without_tokenising_it(spied):
    server, log, _ = spied
    assert _post(server, SMALL).status_code == 200
    assert ("start", len(SMALL["prompt"])) in tokenizer_spy.calls(log), "the spy sees the server's tokenizer"
    long_prompt = "1+1=" * 1000  # 4,000 characters: at least 800 tokens for a context of 256
    for path, body in (("/v1/completions", {"prompt": long_prompt}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_prompt}]})):
        response = _post(server, body, path)
        assert response.status_code == 400, response.text
        assert "characters" in response.json()["error"]["message"] and "max_model_len" in response.json()["error"]["message"]
    assert all(length < len(long_prompt) for _, length in tokenizer_spy.calls(log)), "a long prompt was tokenised"


def test_health_and_other_requests_are_answered_while_a_tokenisation_runs(spied):
    server, log, release = spied
    held_prompt = tokenizer_spy.HOLD + "1+1="
    results = {}
    held = threading.Thread(target=lambda: results.update(held=_post(server, {"prompt": held_prompt, "max_tokens": 2})))
    held.start()
    deadline = time.monotonic() + 120
    while ("start", len(held_prompt)) not in tokenizer_spy.calls(log):
        assert time.monotonic() < deadline and held.is_alive(), "the held prompt never reached the tokenizer"
        time.sleep(0.05)
    try:
        health = httpx.get(server.url("/health"), timeout=60)
        other = _post(server, SMALL | {"stream": True}, timeout=60)
        still_tokenising = ("end", len(held_prompt)) not in tokenizer_spy.calls(log)
    finally:
        release.touch()
    held.join(timeout=300)
    assert health.status_code == 200
    assert other.status_code == 200 and _streamed_text(other) == "46"
    assert still_tokenising, "the answers came only after the tokenisation had ended"
    assert results["held"].status_code == 200
    os.unlink(release)
