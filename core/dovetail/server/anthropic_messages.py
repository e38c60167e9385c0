"""``POST /v1/messages`` (Anthropic's Messages API, which Claude Code and Anthropic's SDKs speak) and
``POST /v1/messages/count_tokens``.

A message runs as a chat completion (:mod:`dovetail.server.chat`): the same chat template, tool parser,
reasoning parser and sampling. Its ``content`` is a list of blocks: ``thinking`` (where the server has a
reasoning parser), ``text``, and a ``tool_use`` block per tool call, with ``stop_reason`` ``end_turn``,
``tool_use``, ``stop_sequence`` or ``max_tokens``. A stream sends Anthropic's events: ``message_start``; per
block ``content_block_start``, its ``content_block_delta`` events (``thinking_delta``, ``text_delta``,
``input_json_delta``) and ``content_block_stop``; then ``message_delta`` (the stop reason and the output
tokens) and ``message_stop``.
"""

from __future__ import annotations

import json
import uuid
from typing import Optional

from fastapi import Request, Response

from dovetail.engine.async_engine import NewRequest
from dovetail.errors import RequestError
from dovetail.outputs import CompletionOutput, RequestOutput
from dovetail.server.anthropic_protocol import MessagesBody, MessagesRequest, anthropic_field_names
from dovetail.server.chat import _Chat
from dovetail.server.errors import APIError, error_body
from dovetail.server.metrics import RequestTracker
from dovetail.server.state import ServerState
from dovetail.server.streaming import respond, sse_event


class ContentBlocks:
    """A message's content blocks, built from the pieces of its text: each piece gives the events that
    announce it; :meth:`close` finishes the last block."""

    def __init__(self):
        self.blocks: list[dict] = []
        self.open: Optional[dict] = None
        self.arguments = ""  # the open tool_use block's JSON text so far

    def feed(self, delta: dict) -> list[dict]:
        """The events for one delta of the chat stream (``reasoning_content``, ``content``, ``tool_calls``)."""
        events = []
        if delta.get("reasoning_content"):
            events += self._write("thinking", delta["reasoning_content"])
        if delta.get("content"):
            events += self._write("text", delta["content"])
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):
                events += self.close()
                events += self._start({"type": "tool_use", "id": call["id"], "name": function.get("name"),
                                       "input": {}})
            piece = function.get("arguments")
            if piece and self.open is not None and self.open["type"] == "tool_use":
                self.arguments += piece
                events.append(self._delta({"type": "input_json_delta", "partial_json": piece}))
        return events

    def _write(self, kind: str, piece: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self.close()
            events += self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                  else {"type": "text", "text": ""})
        self.open[kind] += piece
        delta = {"type": "thinking_delta", "thinking": piece} if kind == "thinking" else {"type": "text_delta",
                                                                                            "text": piece}
        return events + [self._delta(delta)]

    def _start(self, block: dict) -> list[dict]:
        self.open, self.arguments = block, ""
        return [{"type": "content_block_start", "index": len(self.blocks), "content_block": dict(block)}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.blocks), "delta": delta}

    def close(self) -> list[dict]:
        """Finish the open block; its closing event."""
        block = self.open
        if block is None:
            return []
        if block["type"] == "tool_use":
            try:
                block["input"] = json.loads(self.arguments) if self.arguments.strip() else {}
            except ValueError:  # cut short by max_tokens
                block["input"] = {}
        self.blocks.append(block)
        self.open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


def _stop(completion: CompletionOutput, blocks: list[dict]) -> tuple[str, Optional[str]]:
    """``(stop_reason, stop_sequence)`` of a finished output."""
    if completion.finish_reason == "length":
        return "max_tokens", None
    if any(block["type"] == "tool_use" for block in blocks):
        return "tool_use", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


class _Message:
    """One Messages request: the chat request that runs it and how its output becomes content blocks."""

    def __init__(self, state: ServerState, body: MessagesRequest):
        self.state, self.body = state, body
        messages, origins = body.conversation()
        self.names = anthropic_field_names(origins)
        try:
            self.chat = _Chat(state, body.chat(messages))
        except RequestError as exc:
            raise self.names.error(exc) from None
        # max_tokens is a cap here, as Anthropic's clients use it (Claude Code asks for 32,000 whatever the
        # model's context): what the prompt leaves of the context bounds it instead of refusing the request.
        room = state.max_model_len - len(self.chat.prompt_ids)
        self.chat.body.max_completion_tokens = min(body.max_tokens, room)
        self.id = f"msg_{uuid.uuid4().hex}"

    def engine_requests(self) -> list[NewRequest]:
        try:
            return self.chat.engine_requests()
        except RequestError as exc:
            raise self.names.error(exc) from None

    def usage(self, out: Optional[RequestOutput]) -> dict:
        cached = out.num_cached_tokens if out else 0
        return {"input_tokens": len(self.chat.prompt_ids) - cached, "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0, "output_tokens": len(out.outputs[0].token_ids) if out else 0}

    def message(self, content: list[dict], stop: tuple[Optional[str], Optional[str]], usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.chat.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    def response(self, finals: dict[str, RequestOutput]) -> dict:
        out = finals[self.chat.id]
        completion = out.outputs[0]
        message, _ = self.chat.output.message(completion.text, completion.finish_reason)
        blocks = ContentBlocks()
        blocks.feed({"reasoning_content": message.get("reasoning_content"), "content": message.get("content")})
        blocks.feed({"tool_calls": message.get("tool_calls")})
        blocks.close()
        return self.message(blocks.blocks, _stop(completion, blocks.blocks), self.usage(out))

    def error_event(self, api: APIError) -> bytes:
        return sse_event(error_body(api.status, api.message, path="/v1/messages"))

    stream_end = None  # Anthropic's stream ends with message_stop

    async def events(self, stream, tracker: RequestTracker):
        blocks = ContentBlocks()
        choice = self.chat.output.stream()
        started = False
        final = completion = None
        async for item in stream:
            tracker.observe(item)
            out = item.output
            if not started:  # the first output knows how much of the prompt the cache held
                started = True
                usage = {**self.usage(out), "output_tokens": 0}
                yield sse_event({"type": "message_start", "message": self.message([], (None, None), usage)})
            if out.finished:
                final = out
            completion = out.outputs[0]
            delta_text, delta_ids = out.deltas[0]
            done = completion.finish_reason is not None
            if not (delta_text or delta_ids or done):
                continue
            for event in blocks.feed(choice.delta(delta_text, final=done, new_tokens=bool(delta_ids))):
                yield sse_event(event)
        if completion is None:
            return
        for event in blocks.close():
            yield sse_event(event)
        stop_reason, stop_sequence = _stop(completion, blocks.blocks)
        yield sse_event({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                         "usage": self.usage(final)})
        yield sse_event({"type": "message_stop"})


async def create_message(body: MessagesRequest, request: Request) -> Response:
    return await respond(request, body, _Message)


async def count_message_tokens(body: MessagesBody, request: Request) -> dict:
    """The prompt's tokens (``{"input_tokens": N}``) as ``/v1/messages`` would render it."""
    state: ServerState = request.app.state.server

    def count() -> int:
        messages, origins = body.conversation()
        try:
            return len(_Chat(state, body.chat_request(messages)).prompt_ids)
        except RequestError as exc:
            raise anthropic_field_names(origins).error(exc) from None

    return {"input_tokens": await state.off_loop(count)}
