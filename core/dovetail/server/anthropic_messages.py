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
from dovetail.server.errors import ANTHROPIC_PATH, APIError, error_body
from dovetail.server.metrics import RequestTracker
from dovetail.server.output_parts import CALL, REASONING, TEXT, OutputParts, chat_deltas
from dovetail.server.state import ServerState
from dovetail.server.streaming import respond, sse_event


class ContentBlocks(OutputParts):
    """A message's content blocks (``thinking``, ``text``, ``tool_use``) and their stream events."""

    def started(self, kind, call_id=None, name=None):
        if kind == REASONING:
            block = {"type": "thinking", "thinking": "", "signature": ""}
        elif kind == TEXT:
            block = {"type": "text", "text": ""}
        else:
            block = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
        return block, [{"type": "content_block_start", "index": self.index, "content_block": dict(block)}]

    def grown(self, piece):
        if self.open_kind == CALL:
            delta = {"type": "input_json_delta", "partial_json": piece}
        elif self.open_kind == REASONING:
            delta = {"type": "thinking_delta", "thinking": piece}
        else:
            delta = {"type": "text_delta", "text": piece}
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def finished(self, status):
        block = self.open
        if self.open_kind == CALL:
            try:
                block["input"] = json.loads(self.text) if self.text.strip() else {}
            except ValueError:  # cut short by max_tokens
                block["input"] = {}
        else:
            block["thinking" if self.open_kind == REASONING else "text"] = self.text
        return [{"type": "content_block_stop", "index": self.index}]


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
        blocks.add_message(message)
        return self.message(blocks.parts, _stop(completion, blocks.parts), self.usage(out))

    def error_event(self, api: APIError) -> bytes:
        return sse_event(error_body(api.status, api.message, path=ANTHROPIC_PATH))

    stream_end = None  # Anthropic's stream ends with message_stop

    async def events(self, stream, tracker: RequestTracker):
        blocks = ContentBlocks()
        choice = self.chat.output.stream()
        started = False
        final = completion = None
        async for out, completion, delta in chat_deltas(stream, tracker, choice):
            if not started:  # the first output knows how much of the prompt the cache held
                started = True
                usage = {**self.usage(out), "output_tokens": 0}
                yield sse_event({"type": "message_start", "message": self.message([], (None, None), usage)})
            if out.finished:
                final = out
            for event in blocks.feed(delta):
                yield sse_event(event)
        if completion is None:
            return
        for event in blocks.close():
            yield sse_event(event)
        stop_reason, stop_sequence = _stop(completion, blocks.parts)
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
