"""ASGI middleware: the API key check (401) and the request-body size limit (413).

Both are plain ASGI so that streaming responses and disconnect detection pass
through untouched.
"""

from __future__ import annotations

import hmac
from typing import Iterable

from dovetail.server.errors import error_bytes

#: Oversized bodies are read and discarded up to this many bytes past the limit before the 413 is sent, so
#: the client is not reset while it is still sending; beyond that the connection is simply answered.
_DRAIN_BYTES = 64 * 1024 * 1024


async def _send_error(send, status: int, message: str, code: str, headers: Iterable = ()) -> None:
    body = error_bytes(status, message, code=code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on every path except the open ones (``/health``)."""

    def __init__(self, app, api_key: str, open_paths: Iterable[str] = ("/health",)):
        self.app = app
        self.expected = api_key.encode()
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.expected):
            reason = "missing" if not given else "wrong"
            return await _send_error(send, 401, f"authorization: {reason} API key; send the header "
                                     "'Authorization: Bearer <key>'", "invalid_api_key",
                                     [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Answers 413 to request bodies larger than ``max_bytes`` (by Content-Length, or as they stream)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._drain(receive, int(length))
            return await self._reject(send)
        if length is not None:
            return await self.app(scope, receive, send)
        # No Content-Length (chunked): buffer up to the limit, then replay.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await self._drain(receive, size + _DRAIN_BYTES)
                return await self._reject(send)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _drain(self, receive, length: int) -> None:
        read = 0
        while read < min(length, self.max_bytes + _DRAIN_BYTES):
            message = await receive()
            if message["type"] != "http.request":
                return
            read += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    async def _reject(self, send) -> None:
        await _send_error(send, 413, f"body: the request body exceeds the limit of {self.max_bytes} bytes "
                          "(--max-body-bytes)", "request_too_large")
