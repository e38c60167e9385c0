"""ASGI middleware: the Host allow-list (400), the API key check (401) and the request-body size limit (413).

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


async def _send_error(scope, send, status: int, message: str, code: str, headers: Iterable = ()) -> None:
    body = error_bytes(status, message, code=code, path=scope.get("path", ""))
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key: <key>``) on every path except the
    open ones (``/health``)."""

    def __init__(self, app, api_key: str, open_paths: Iterable[str] = ("/health",)):
        self.app = app
        self.expected = api_key.encode()
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        api_key = headers.get(b"x-api-key")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected):
            return await self.app(scope, receive, send)
        if api_key is not None and hmac.compare_digest(api_key.strip(), self.expected):
            return await self.app(scope, receive, send)
        reason = "missing" if not (given or api_key) else "wrong"
        return await _send_error(scope, send, 401, f"authorization: {reason} API key; send the header "
                                 "'Authorization: Bearer <key>' (or 'x-api-key: <key>')", "invalid_api_key",
                                 [(b"www-authenticate", b"Bearer")])


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
            return await self._reject(scope, send)
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
                return await self._reject(scope, send)
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

    async def _reject(self, scope, send) -> None:
        await _send_error(scope, send, 413, f"body: the request body exceeds the limit of {self.max_bytes} bytes "
                          "(--max-body-bytes)", "request_too_large")


def host_name(host_header: str) -> str:
    """The host of a Host header, without its port, lower-cased (``[::1]:8000`` -> ``[::1]``)."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0].rstrip(".") if ":" in host else host.rstrip(".")


class AllowedHostsMiddleware:
    """Answers 400 to requests whose Host header names a host not in ``allowed_hosts``.

    A web page can make a browser send requests to a server on the user's machine by pointing its own
    domain name at 127.0.0.1 (DNS rebinding); such requests carry the page's domain in the Host header,
    so answering only the names the server is reached by closes that door. Entries are host names or
    addresses (any port), ``*.example.com`` for the subdomains of a domain, or ``*`` for any host.
    """

    def __init__(self, app, allowed_hosts: Iterable[str]):
        self.app = app
        self.allowed = [h.strip().lower() for h in allowed_hosts]

    def allows(self, host: str) -> bool:
        return any(pattern == "*" or host == pattern or (pattern.startswith("*.") and host.endswith(pattern[1:]))
                   for pattern in self.allowed)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if self.allows(host_name(given)):
            return await self.app(scope, receive, send)
        return await _send_error(scope, send, 400, f"host: {given!r} is not a name this server answers to (allowed: "
                                 f"{', '.join(self.allowed)}; --allowed-hosts)", "host_not_allowed")
