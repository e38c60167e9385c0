"""``dovetail serve -tp 2``: it answers; when a worker dies, the requests in flight get ``engine_error``, new
ones a 503, and the server exits with a non-zero status, leaving no worker behind."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from test_server_cli import ServerProcess
from test_server_shutdown import LONG, Events
from test_tp_failures import _wait_gone


@pytest.fixture(scope="module")
def long_context_dir(tmp_path_factory):
    import tiny_models

    return tiny_models.save_model(tmp_path_factory.mktemp("tiny-llama-8k"),
                                  tiny_models.tiny_llama_config(max_position_embeddings=8192))


def _children(pid: int) -> list[int]:
    pids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            pids += [int(p) for p in f.read().split()]
    return sorted(pids)


def _worker_pids(server_pid: int) -> list[int]:
    """The server's worker processes: the children of the fork server the server started (neither the fork
    server nor multiprocessing's resource tracker is a worker)."""
    workers = []
    for pid in _children(server_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"forkserver" in f.read():
                workers += _children(pid)
    return workers


def _running(server) -> float:
    text = httpx.get(server.url("/metrics"), timeout=10).text
    line = next(l for l in text.splitlines() if l.startswith("dovetail_num_requests_running "))
    return float(line.split()[1])


def test_tp2_server_answers_then_fails_in_flight_requests_when_a_worker_dies(long_context_dir):
    server = ServerProcess(long_context_dir, "-tp", "2", "--device", "cpu", "--attention-backend", "REFERENCE",
                           startup_timeout=300)  # three processes start on a machine that may be busy
    try:
        ok = httpx.post(server.url("/v1/completions"), json={"prompt": "hi", "max_tokens": 5, "ignore_eos": True},
                        timeout=60)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 5
        workers = _worker_pids(server.proc.pid)
        assert len(workers) == 2

        answers = []
        plain = threading.Thread(target=lambda: answers.append(httpx.post(
            server.url("/v1/completions"), json=LONG | {"stream": False, "max_tokens": 8000}, timeout=120)))
        plain.start()
        with httpx.stream("POST", server.url("/v1/completions"), json=LONG | {"max_tokens": 8000},
                          timeout=120) as response:
            stream = Events(response)
            stream.next()
            deadline = time.monotonic() + 60
            while _running(server) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            os.kill(workers[1], signal.SIGKILL)
            events = stream.rest()
        plain.join(120)
        error = events[-1]["error"]
        assert error["code"] == "engine_error" and "worker rank 1" in error["message"], error
        assert answers[0].status_code == 500, answers[0].text
        assert answers[0].json()["error"]["code"] == "engine_error"
        assert server.proc.wait(60) != 0
        _wait_gone(workers)
        assert "worker rank 1" in server.output()
    finally:
        server.stop(signal.SIGKILL)
