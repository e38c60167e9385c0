"""``dovetail serve`` as a process, and the launcher the other server tests share.

:func:`shared_server` starts ``python -m dovetail.cli.main serve`` on a free
loopback port (one process per distinct set of flags, reused across test
modules and stopped at exit); :class:`ServerProcess` starts a private one.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

API_KEY = "sk-dovetail-test"
#: Flags of the server most tests share (``tiny`` and ``tiny-alias`` name the model).
MAIN_FLAGS = ("--api-key", API_KEY, "--served-model-name", "tiny", "tiny-alias", "--max-model-len", "512",
              "--max-body-bytes", "200000", "--max-num-seqs", "128")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A ``dovetail serve`` subprocess on a free loopback port, ready once ``/health`` answers 200."""

    def __init__(self, model_dir, *flags: str, startup_timeout: float = 180.0):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="dovetail-serve-", suffix=".log", delete=False)
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
        env.pop("DOVETAIL_API_KEY", None)
        cmd = [sys.executable, "-m", "dovetail.cli.main", "--log-level", "WARNING", "serve", str(model_dir),
               "--port", str(self.port), "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", *flags]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dovetail serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url("/health"), timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        output = self.output()
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"dovetail serve did not become healthy in {timeout}s:\n{output}")

    def url(self, path: str) -> str:
        return self.base_url + path

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Stop the server (if it still runs) and remove its log."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if os.path.exists(self.log.name):
            os.unlink(self.log.name)
        return self.proc.returncode


_SHARED: dict[tuple, ServerProcess] = {}


def shared_server(model_dir, *flags: str) -> ServerProcess:
    """One server per (model, flags) for the whole test session."""
    key = (str(model_dir), *flags)
    server = _SHARED.get(key)
    if server is None or server.proc.poll() is not None:
        server = _SHARED[key] = ServerProcess(model_dir, *flags)
    return server


@atexit.register
def _stop_shared() -> None:
    for server in _SHARED.values():
        server.stop(timeout=10)


def auth(key: str = API_KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


# -- tests of the command line itself ----------------------------------------------------------------------------


def test_serve_help_lists_server_and_engine_flags():
    out = subprocess.run([sys.executable, "-m", "dovetail.cli.main", "serve", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for flag in ("--host", "--port", "--served-model-name", "--api-key", "--max-waiting-requests", "--max-body-bytes",
                 "--device", "--attention-backend", "--quantization", "--dtype", "--max-model-len"):
        assert flag in out


def test_serve_rejects_a_bad_flag_value_naming_it(tiny_llama_dir):
    done = subprocess.run([sys.executable, "-m", "dovetail.cli.main", "serve", str(tiny_llama_dir),
                           "--max-waiting-requests", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--max-waiting-requests" in done.stderr


def test_api_key_from_environment(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("DOVETAIL_API_KEY", "sk-from-env")
    from dovetail.cli.main import build_parser

    args = build_parser().parse_args(["serve", str(tiny_llama_dir)])
    captured = {}

    def fake_serve(model, kwargs, settings, **options):
        captured.update(model=model, kwargs=kwargs, settings=settings, options=options)
        return 0

    monkeypatch.setattr("dovetail.server.launcher.serve", fake_serve)
    assert args.func(args) == 0
    assert captured["settings"].api_key == "sk-from-env"
    assert captured["settings"].served_model_names == [str(tiny_llama_dir)]
    assert captured["options"]["host"] == "127.0.0.1" and captured["options"]["port"] == 8000


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    return shared_server(tiny_llama_dir, *MAIN_FLAGS)


def test_health_needs_no_key_but_everything_else_does(server):
    assert httpx.get(server.url("/health")).status_code == 200
    for method, path in (("GET", "/v1/models"), ("GET", "/version"), ("GET", "/metrics"),
                         ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
                         ("POST", "/detokenize"), ("GET", "/openapi.json")):
        for headers in ({}, auth("sk-wrong")):
            r = httpx.request(method, server.url(path), headers=headers, json={})
            assert r.status_code == 401, (method, path, r.text)
            error = r.json()["error"]
            assert error["code"] == "invalid_api_key" and "API key" in error["message"]
    assert httpx.get(server.url("/version"), headers=auth()).json()["version"]
