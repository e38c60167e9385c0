"""Errors in OpenAI's format, ``{"error": {"message", "type", "param", "code"}}``, with the right status (on
the Anthropic Messages paths, ``/v1/messages...``, in Anthropic's: ``{"type": "error", "error": {"type",
"message"}}``).

400 invalid values (the message and ``param`` name the field), 401 a missing or
wrong API key, 404 an unknown model or path, 413 an oversized body, 503 a full
waiting queue or a server shutting down, 500 only for the server's own faults.
"""

from __future__ import annotations

import json
import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dovetail.engine.async_engine import EngineStepError, EngineStoppedError, QueueFullError
from dovetail.errors import RequestError

logger = logging.getLogger("dovetail.server")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error", 503: "server_error"}

#: Requests that generate (counted in the ``dovetail_requests_total`` metric).
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
#: Paths of Anthropic's Messages API, whose clients read Anthropic's error format.
ANTHROPIC_PATH = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error"}


class APIError(Exception):
    """An error answered to the client as is."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
               path: str = "") -> dict:
    """The error's JSON in the format the clients of ``path`` read."""
    if path.startswith(ANTHROPIC_PATH):
        kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                   headers: Optional[dict] = None, path: str = "") -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code, path), status_code=status, headers=headers)


def error_bytes(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                path: str = "") -> bytes:
    return json.dumps(error_body(status, message, param, code, path)).encode()


def request_error_message(exc: RequestError) -> str:
    """The engine's message, starting with the field's name (SamplingParams prefixes its own)."""
    return str(exc).removeprefix("invalid SamplingParams: ")


def to_api_error(exc: BaseException) -> APIError:
    """The client-facing form of an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):
        return APIError(400, request_error_message(exc), exc.field)
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), code="queue_full")
    if isinstance(exc, EngineStoppedError):
        return APIError(503, str(exc), code="shutting_down")
    if isinstance(exc, EngineStepError):  # the engine loop logged the traceback
        return APIError(500, str(exc), code="engine_error")
    logger.error("internal error while serving a request", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}")


def _is_union_tag(part) -> bool:
    """pydantic names the member of a Union it tried (``str``, ``list[int]``, ...) inside error locations."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "none", "dict", "list")
                                      or part.startswith("function-"))


def validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    """``(message, param)`` for the first problem, e.g. ``temperature: must be >= 0 (got -1.0)``."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = [p for p in err.get("loc", ()) if not _is_union_tag(p)]
    if loc and loc[0] == "body":
        loc = loc[1:]
    if err.get("type") == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "invalid JSON")
        position = f" at position {loc[0]}" if loc else ""
        return f"body: malformed JSON{position}: {detail}", None
    if not loc and isinstance(err.get("input"), (bytes, str)):
        return "body: expected a JSON object (send it with 'Content-Type: application/json')", None
    field = ".".join(str(p) for p in loc) or "body"
    message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    got = err.get("input")
    shown = "" if err.get("type") == "missing" or isinstance(got, (dict, list)) else f" (got {got!r:.80})"
    return f"{field}: {message}{shown}", field if loc else None


def unparsable_body_message(cause: Optional[BaseException]) -> str:
    """Why the JSON parser gave up on a body, in the client's terms."""
    if isinstance(cause, RecursionError):
        return "body: the JSON nests arrays or objects too deeply to be parsed"
    if isinstance(cause, UnicodeDecodeError):
        return f"body: not valid UTF-8 (byte {cause.start}: {cause.reason})"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return f"body: a number in the JSON has too many digits ({str(cause).split(';')[0]})"
    detail = f": {type(cause).__name__}: {cause}" if cause is not None else ""
    return f"body: cannot be parsed as JSON{detail}"[:300]


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error, including FastAPI's own, in OpenAI's format."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        state = getattr(request.app.state, "server", None)
        if state is not None and request.url.path in GENERATION_PATHS:
            state.metrics.requests.labels("rejected").inc()
        return error_response(400, message, param, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"path: {request.url.path} is not an endpoint of this server"
        elif exc.status_code == 405:
            message = f"method: {request.method} is not allowed on {request.url.path}"
        elif exc.status_code == 400 and message == "There was an error parsing the body":
            message = unparsable_body_message(exc.__cause__)
            state = getattr(request.app.state, "server", None)
            if state is not None and request.url.path in GENERATION_PATHS:
                state.metrics.requests.labels("rejected").inc()
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None), path=request.url.path)

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, path=request.url.path)

    @app.exception_handler(RequestError)
    async def _request(request: Request, exc: RequestError):
        return error_response(400, request_error_message(exc), exc.field, path=request.url.path)

    @app.exception_handler(QueueFullError)
    @app.exception_handler(EngineStoppedError)
    async def _unavailable(request: Request, exc: Exception):
        api = to_api_error(exc)
        return error_response(api.status, api.message, api.param, api.code, path=request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        api = to_api_error(exc)
        return error_response(api.status, api.message, api.param, api.code, path=request.url.path)
