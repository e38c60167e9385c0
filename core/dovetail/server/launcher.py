"""Running the server: bind the address, build the engine, then serve the app with uvicorn until SIGTERM or Ctrl+C.

On SIGTERM (or the first Ctrl+C) the server stops accepting connections and
new requests, lets running requests finish for up to ``shutdown_timeout``
seconds, then aborts what is left (streams end with an error event and
``[DONE]``, other requests get a 503), stops the engine loop and exits with 0.

If the engine stops for good (a worker died or failed), the requests in flight
get a 500 ``engine_error`` (a stream ends with that error event), new ones a
503, and the server shuts down and exits with 1. The workers are stopped on
every way out.
"""

from __future__ import annotations

import errno
import logging
import signal
import socket
import threading

from dovetail.errors import ConfigError
from dovetail.server.state import ServerSettings

logger = logging.getLogger("dovetail.server")


def _terminated_cleanly(signum, frame) -> None:
    # uvicorn re-raises the signal that stopped it once it has shut down; by then all work is done.
    logger.info("server stopped on signal %d", signum)


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``, made before the model loads so that a wrong host or a port in use
    stops the server at once with one line (uvicorn listens on it once the engine is ready)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ConfigError(f"--host: cannot resolve {host!r} ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"--port: {host}:{port} is already in use; choose another port") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"--host: {host} is not an address of this machine") from None
        if exc.errno == errno.EACCES:
            raise ConfigError(f"--port: this user may not listen on port {port} (ports below 1024 need "
                              "privileges)") from None
        raise ConfigError(f"--host/--port: cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def serve(model: str, engine_kwargs: dict, settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000,
          shutdown_timeout: float = 30.0, uvicorn_log_level: str = "info", access_log: bool = True) -> int:
    """Bind the address, load the model, then serve until stopped; returns the exit status."""
    import uvicorn

    from dovetail.config import EngineArgs
    from dovetail.engine.async_engine import AsyncLLMEngine
    from dovetail.engine.llm_engine import LLMEngine
    from dovetail.server.app import build_app

    sock = bind_socket(host, port)
    failed: list[BaseException] = []
    try:
        llm_engine = LLMEngine(EngineArgs(model, **engine_kwargs).create_engine_config(), usage="server")
        engine = AsyncLLMEngine(llm_engine, on_failure=lambda exc: (failed.append(exc), stop_serving()))
        app = build_app(engine, settings)
    except BaseException:
        sock.close()
        raise
    port = sock.getsockname()[1]
    timers: list[threading.Timer] = []

    class Server(uvicorn.Server):
        """uvicorn's server, whose first SIGINT/SIGTERM also stops new requests and bounds the running
        ones' time by ``shutdown_timeout``."""

        def handle_exit(self, sig, frame):
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first:
                logger.info("shutting down: finishing running requests (at most %gs)", shutdown_timeout)
                engine.stop_accepting()
                timer = threading.Timer(shutdown_timeout, engine.abort_all)
                timer.daemon = True
                timer.start()
                timers.append(timer)

    # uvicorn's own deadline is a backstop: by then our abort has ended every request.
    config = uvicorn.Config(app, host=host, port=port, log_level=uvicorn_log_level, access_log=access_log,
                            timeout_graceful_shutdown=shutdown_timeout + 10, lifespan="on")
    server = Server(config)

    def stop_serving():
        logger.error("the engine stopped (%s); shutting the server down", failed[-1])
        server.should_exit = True

    logger.info("serving %s as %s on http://%s:%d", model, ", ".join(settings.served_model_names), host, port)
    previous = signal.signal(signal.SIGTERM, _terminated_cleanly)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        for timer in timers:
            timer.cancel()
        llm_engine.shutdown()
    return 0 if server.started and not failed else 1
