"""Running the server: build the engine, then serve the app with uvicorn until SIGTERM or Ctrl+C.

On SIGTERM uvicorn stops accepting connections, lets running requests finish
(up to ``shutdown_timeout`` seconds, then cancels them, which aborts their
engine requests), and the engine loop stops; the process then exits with 0.
"""

from __future__ import annotations

import logging
import signal

from dovetail.server.state import ServerSettings

logger = logging.getLogger("dovetail.server")


def _terminated_cleanly(signum, frame) -> None:
    # uvicorn re-raises the signal that stopped it once it has shut down; by then all work is done.
    logger.info("server stopped on signal %d", signum)


def serve(model: str, engine_kwargs: dict, settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000,
          shutdown_timeout: float = 30.0, uvicorn_log_level: str = "info", access_log: bool = True) -> int:
    """Load the model, then serve until stopped; returns the exit status."""
    import uvicorn

    from dovetail.config import EngineArgs
    from dovetail.engine.async_engine import AsyncLLMEngine
    from dovetail.engine.llm_engine import LLMEngine
    from dovetail.server.app import build_app

    engine = LLMEngine(EngineArgs(model, **engine_kwargs).create_engine_config())
    app = build_app(AsyncLLMEngine(engine), settings)
    config = uvicorn.Config(app, host=host, port=port, log_level=uvicorn_log_level, access_log=access_log,
                            timeout_graceful_shutdown=int(shutdown_timeout), lifespan="on")
    server = uvicorn.Server(config)
    logger.info("serving %s as %s on http://%s:%d", model, ", ".join(settings.served_model_names), host, port)
    previous = signal.signal(signal.SIGTERM, _terminated_cleanly)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0 if server.started else 1
