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
#: The tiny Llama's server that most server tests share. It decodes speculatively (n-gram drafts), which must
#: leave every answer as plain decoding gives it, so that every test of it checks that too.
MAIN_FLAGS = ("--api-key", API_KEY, "--served-model-name", "tiny", "tiny-alias", "--max-model-len", "512",
              "--max-body-bytes", "200000", "--max-num-seqs", "128",
              "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, '
                                      '"prompt_lookup_min": 1}')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A ``dovetail serve`` subprocess on a free loopback port, ready once ``/health`` answers 200."""

    def __init__(self, model_dir, *flags: str, startup_timeout: float = 180.0, preload: str | None = None,
                 env: dict | None = None):
        """``preload`` names a module of tests/ the server process imports first (a spy); ``env`` adds variables."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="dovetail-serve-", suffix=".log", delete=False)
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), **(env or {}))
        env.pop("DOVETAIL_API_KEY", None)
        launcher = ["-m", "dovetail.cli.main"]
        if preload is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(__file__), env.get("PYTHONPATH")]))
            launcher = ["-c", f"import sys, {preload}; from dovetail.cli.main import main; sys.exit(main())"]
        cmd = [sys.executable, *launcher, "--log-level", "WARNING", "serve", str(model_dir),
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


def shared_server(model_dir, *flags: str, env: dict | None = None) -> ServerProcess:
    """One server per (model, flags, environment) for the whole test session."""
    key = (str(model_dir), *flags, *sorted((env or {}).items()))
    server = _SHARED.get(key)
    if server is None or server.proc.poll() is not None:
        server = _SHARED[key] = ServerProcess(model_dir, *flags, env=env)
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
                 "--max-sequences-per-request", "--allowed-hosts", "--chat-template", "--device", "--attention-backend", "--quantization", "--dtype", "--max-model-len"):
        assert flag in out


def test_serve_rejects_a_bad_flag_value_naming_it(tiny_llama_dir):
    done = subprocess.run([sys.executable, "-m", "dovetail.cli.main", "serve", str(tiny_llama_dir),
                           "--max-waiting-requests", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--max-waiting-requests" in done.stderr


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dovetail.cli.main", "--log-level", "INFO", "serve", *args],
                          capture_output=True, text=True, timeout=300)


def _engine_was_built(output: str) -> bool:
    return "engine ready" in output or "chosen automatically" in output


def test_a_bad_port_is_one_line_before_the_model_loads(tiny_llama_dir):
    done = _serve(str(tiny_llama_dir), "--port", "99999")
    assert done.returncode == 2
    assert done.stderr.strip() == "error: --port: must be at most 65535 (got 99999)"
    assert not _engine_was_built(done.stderr + done.stdout)


def test_a_port_in_use_stops_the_server_before_the_model_loads(tiny_llama_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = _serve(str(tiny_llama_dir), "--port", str(port))
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if not line.startswith("INFO")]
    assert errors == [f"error: --port: 127.0.0.1:{port} is already in use; choose another port"]
    assert "Traceback" not in done.stderr and not _engine_was_built(done.stderr)


def test_a_host_that_is_not_here_is_one_line(tiny_llama_dir):
    done = _serve(str(tiny_llama_dir), "--host", "name.that-does-not-resolve.invalid")
    assert done.returncode == 2 and "error: --host: cannot resolve" in done.stderr
    assert "Traceback" not in done.stderr and not _engine_was_built(done.stderr)


def test_generate_refuses_an_empty_prompt_before_loading(tiny_llama_dir):
    done = subprocess.run([sys.executable, "-m", "dovetail.cli.main", "--log-level", "INFO", "generate", "12+34=", "",
                           "--model", str(tiny_llama_dir)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "error: prompt: prompt 2 is empty" in done.stderr and not _engine_was_built(done.stderr)


def test_allowed_hosts_default_to_loopback_names_only_where_rebinding_reaches():
    from dovetail.cli.serve_cmd import LOOPBACK_NAMES, allowed_hosts
    from dovetail.server.middleware import AllowedHostsMiddleware, host_name

    assert allowed_hosts(None, "127.0.0.1", None) == LOOPBACK_NAMES
    assert allowed_hosts(None, "::1", None) == LOOPBACK_NAMES
    assert allowed_hosts(None, "localhost", None) == LOOPBACK_NAMES
    assert allowed_hosts(None, "127.0.0.1", "sk-key") is None, "the key already closes the door"
    assert allowed_hosts(None, "0.0.0.0", None) is None, "the names it is reached by are unknown"
    assert allowed_hosts(["api.example.com"], "0.0.0.0", None) == ["api.example.com"]
    assert allowed_hosts(["*"], "127.0.0.1", None) is None
    assert [host_name(h) for h in ("127.0.0.1:8000", "[::1]:8000", "LocalHost", "localhost.:80")] == \
        ["127.0.0.1", "[::1]", "localhost", "localhost"]
    middleware = AllowedHostsMiddleware(None, ["api.example.com", "*.internal.example"])
    assert middleware.allows("api.example.com") and middleware.allows("a.b.internal.example")
    assert not middleware.allows("internal.example") and not middleware.allows("evil.com")


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
