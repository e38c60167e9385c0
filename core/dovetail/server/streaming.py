"""Running a generation request to its end: server-sent events or one response, aborted on disconnect.

Whichever way a request ends, its engine requests are aborted if unfinished
(freeing their KV-cache blocks at once) and its outcome is counted once.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from dovetail.engine.async_engine import NewRequest, RequestStream
from dovetail.outputs import RequestOutput
from dovetail.server.errors import APIError, error_body, to_api_error
from dovetail.server.metrics import RequestTracker
from dovetail.server.state import ServerState

DONE = b"data: [DONE]\n\n"


def finite(value: float) -> float:
    """JSON has no infinities: clamp a -inf logprob as vLLM does."""
    return -9999.0 if value is None or math.isinf(value) or math.isnan(value) else value


def sse(data: dict) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def sse_event(data: dict) -> bytes:
    """A server-sent event named by its data's ``type`` (as the Responses API streams)."""
    return b"event: " + data["type"].encode() + b"\n" + sse(data)


def outcome_of(api: APIError, started: bool = True) -> str:
    """The ``dovetail_requests_total`` outcome of a request that ended in ``api``."""
    if api.status == 503:
        return "aborted" if started and api.code == "shutting_down" else "overloaded"
    return "error" if api.status >= 500 else "rejected"


async def start(state: ServerState, tracker: RequestTracker,
                prepare: Callable[[], list[NewRequest]]) -> RequestStream:
    """Prepare (off the event loop) and queue the engine requests; count a refusal and raise it as an
    :class:`APIError`."""
    try:
        return await state.engine.add(await state.off_loop(prepare), tracker.arrival)
    except Exception as exc:
        api = to_api_error(exc)
        tracker.finish(outcome_of(api, started=False))
        raise api from None


async def wait_for_disconnect(request: Request) -> None:
    """Return once the client has gone away (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientDisconnected(Exception):
    """The client went away before its response was ready."""


async def collect(stream: RequestStream, tracker: RequestTracker, request: Request) -> dict[str, RequestOutput]:
    """The final output of every engine request of ``stream``; aborts them if the client disconnects."""
    finals: dict[str, RequestOutput] = {}

    async def consume():
        async for item in stream:
            tracker.observe(item)
            if item.output.finished:
                finals[item.output.request_id] = item.output

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not consumer.done():
            raise ClientDisconnected()
        error = consumer.exception()
        if error is not None:
            api = to_api_error(error)
            tracker.finish(outcome_of(api))
            raise api
        tracker.finish("finished")
        return finals
    finally:
        consumer.cancel()
        watcher.cancel()
        stream.abort()
        if not tracker.done:
            tracker.finish("aborted")


def event_stream(stream: RequestStream, tracker: RequestTracker, events: AsyncIterator[bytes],
                 error_event: Optional[Callable[[APIError], bytes]] = None,
                 end: Optional[bytes] = DONE) -> StreamingResponse:
    """Server-sent events ending in ``end`` (chat's and completions' ``data: [DONE]``); an engine failure
    becomes an error event (``error_event``'s, else OpenAI's error body)."""

    async def guarded():
        try:
            async for chunk in events:
                yield chunk
            tracker.finish("finished")
        except Exception as exc:  # the stream has started: report in-band, as OpenAI does
            api = exc if isinstance(exc, APIError) else to_api_error(exc)
            tracker.finish(outcome_of(api))
            yield (error_event(api) if error_event is not None
                   else sse(error_body(api.status, api.message, api.param, api.code)))
        finally:
            stream.abort()
            if not tracker.done:
                tracker.finish("aborted")
        if end is not None:
            yield end

    return StreamingResponse(guarded(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def respond(request: Request, body: Any, build: Callable[[ServerState, Any], Any]) -> Response:
    """Run one API request to its end: ``build(state, body)``, called off the event loop, makes its handler
    (``engine_requests()``, ``events(stream, tracker)``, ``response(finals)``, and optionally ``error_event``
    and ``stream_end`` for :func:`event_stream`); server-sent events when ``body.stream``, else one JSON
    response; 499 when the client goes away first."""
    state: ServerState = request.app.state.server
    tracker = RequestTracker(state.metrics, time.monotonic())
    handler: list = []

    def prepare():
        handler.append(build(state, body))
        return handler[0].engine_requests()

    stream = await start(state, tracker, prepare)
    if getattr(body, "stream", False):
        return event_stream(stream, tracker, handler[0].events(stream, tracker),
                            getattr(handler[0], "error_event", None), getattr(handler[0], "stream_end", DONE))
    try:
        finals = await collect(stream, tracker, request)
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(handler[0].response(finals))
