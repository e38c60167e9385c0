"""A full waiting queue answers 503; SIGTERM lets running work finish and the process exits with 0."""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from test_server_cli import ServerProcess

LONG = {"prompt": "hi", "max_tokens": 400, "stream": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def long_context_dir(tmp_path_factory):
    """A tiny Llama with an 8k context, so that a request can run for thousands of steps."""
    import tiny_models

    return tiny_models.save_model(tmp_path_factory.mktemp("tiny-llama-8k"),
                                  tiny_models.tiny_llama_config(max_position_embeddings=8192))


@pytest.fixture(scope="module")
def server(long_context_dir):
    # One sequence runs at a time and two may wait.
    server = ServerProcess(long_context_dir, "--max-num-seqs", "1", "--max-waiting-requests", "2",
                           "--shutdown-timeout", "60")
    yield server
    server.stop(signal.SIGKILL)


class Events:
    """The data events of a streaming response, read from one iterator (breaking out of ``iter_lines``
    would close the connection, which the server rightly takes for a client that went away)."""

    def __init__(self, response):
        self.lines = response.iter_lines()
        self.done = False

    def next(self) -> dict:
        for line in self.lines:
            if line.startswith("data: {"):
                return json.loads(line[6:])
        raise AssertionError("the stream ended without another event")

    def rest(self) -> list[dict]:
        events = []
        for line in self.lines:
            if line == "data: [DONE]":
                self.done = True
            elif line.startswith("data: {"):
                events.append(json.loads(line[6:]))
        return events


def test_full_waiting_queue_answers_503_then_recovers(server):
    # The first request's two sequences take thousands of steps: one runs, one waits; the second request waits
    # too, and the third finds two sequences waiting.
    first = LONG | {"n": 2, "max_tokens": 4000}
    with httpx.Client(timeout=60) as a, httpx.Client(timeout=60) as b:
        with a.stream("POST", server.url("/v1/completions"), json=first) as running:
            running_events = Events(running)
            running_events.next()
            with b.stream("POST", server.url("/v1/completions"), json=LONG) as waiting:
                assert waiting.status_code == 200
                full = httpx.post(server.url("/v1/completions"), json={"prompt": "hi", "max_tokens": 2}, timeout=60)
                assert full.status_code == 503, full.text
                error = full.json()["error"]
                assert error["code"] == "queue_full" and "max_waiting_requests" in error["message"]
                assert error["type"] == "server_error"
    # Both streams were closed: their requests are aborted and the queue is free again.
    ok = httpx.post(server.url("/v1/completions"), json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    metrics = httpx.get(server.url("/metrics")).text
    assert 'dovetail_requests_total{outcome="overloaded"} 1.0' in metrics
    assert 'dovetail_kv_cache_usage_perc 0.0' in metrics


def test_sigterm_finishes_the_running_stream_and_exits_cleanly(server):
    body = LONG | {"max_tokens": 200, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60) as response:
        stream = Events(response)
        events = [stream.next()]
        server.proc.send_signal(signal.SIGTERM)
        events += stream.rest()
    assert stream.done
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 200  # no token lost to the shutdown
    assert server.proc.wait(60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url("/health"), timeout=5)
    assert "Traceback" not in server.output()


def test_sigterm_aborts_work_left_after_the_shutdown_timeout(long_context_dir):
    server = ServerProcess(long_context_dir, "--shutdown-timeout", "0")
    try:
        with httpx.stream("POST", server.url("/v1/completions"), json=LONG | {"max_tokens": 8000},
                          timeout=60) as response:
            stream = Events(response)
            stream.next()
            server.proc.send_signal(signal.SIGTERM)
            events = stream.rest()
        assert stream.done
        assert events[-1]["error"]["code"] == "shutting_down"  # cut short, and told so
        assert len(events) < 7999
        assert server.proc.wait(60) == 0
        assert "Traceback" not in server.output()
    finally:
        server.stop(signal.SIGKILL)
