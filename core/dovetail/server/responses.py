"""``POST /v1/responses`` (OpenAI's Responses API), and ``GET`` / ``DELETE /v1/responses/{id}`` on stored ones.

A response runs as a chat completion (:mod:`dovetail.server.chat`): the same chat template, tool parser,
reasoning parser and structured outputs. Its output is a list of items: the reasoning (where the server has
a reasoning parser), the message, and a ``function_call`` per tool call. A stream sends OpenAI's events:
``response.created`` and ``response.in_progress``; for each item ``response.output_item.added``, its deltas
(``response.reasoning_text.delta``; ``response.content_part.added`` then ``response.output_text.delta``;
``response.function_call_arguments.delta``), their ``.done`` events and ``response.output_item.done``; last
``response.completed``, or ``response.incomplete`` when ``max_output_tokens`` cut the output short.
"""

from __future__ import annotations

import copy
import itertools
import time
import uuid
from typing import Optional

from fastapi import Request, Response

from dovetail.engine.async_engine import NewRequest
from dovetail.errors import RequestError
from dovetail.outputs import RequestOutput
from dovetail.server.chat import _Chat
from dovetail.server.errors import APIError
from dovetail.server.metrics import RequestTracker
from dovetail.server.output_parts import CALL, REASONING, TEXT, OutputParts, chat_deltas
from dovetail.server.response_store import STORE_ENV, StoredResponse
from dovetail.server.responses_protocol import ResponsesRequest, responses_field_names
from dovetail.server.state import ServerState
from dovetail.server.streaming import respond, sse_event


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems(OutputParts):
    """A response's output items (``reasoning``, ``message``, ``function_call``) and their stream events."""

    def started(self, kind, call_id=None, name=None):
        where = {"output_index": self.index}
        if kind == REASONING:
            item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
        elif kind == TEXT:
            item = {"id": _new_id("msg"), "type": "message", "role": "assistant", "content": [],
                    "status": "in_progress"}
        else:
            item = {"id": _new_id("fc"), "type": "function_call", "call_id": call_id, "name": name, "arguments": "",
                    "status": "in_progress"}
        events = [{"type": "response.output_item.added", **where, "item": copy.deepcopy(item)}]
        if kind == TEXT:
            events.append({"type": "response.content_part.added", "item_id": item["id"], **where,
                           "content_index": 0, "part": _text_part("")})
        return item, events

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": self.index}

    def grown(self, piece):
        if self.open_kind == CALL:
            return {"type": "response.function_call_arguments.delta", **self._where(), "delta": piece}
        if self.open_kind == REASONING:
            return {"type": "response.reasoning_text.delta", **self._where(), "content_index": 0, "delta": piece}
        return {"type": "response.output_text.delta", **self._where(), "content_index": 0, "delta": piece,
                "logprobs": []}

    def finished(self, status):
        item, where = self.open, self._where()
        item["status"] = status
        if self.open_kind == REASONING:
            item["content"] = [{"type": "reasoning_text", "text": self.text}]
            events = [{"type": "response.reasoning_text.done", **where, "content_index": 0, "text": self.text}]
        elif self.open_kind == TEXT:
            part = _text_part(self.text)
            item["content"] = [part]
            events = [{"type": "response.output_text.done", **where, "content_index": 0, "text": self.text,
                       "logprobs": []},
                      {"type": "response.content_part.done", **where, "content_index": 0, "part": part}]
        else:
            item["arguments"] = self.text
            events = [{"type": "response.function_call_arguments.done", **where, "name": item["name"],
                       "arguments": self.text}]
        return events + [{"type": "response.output_item.done", "output_index": self.index,
                          "item": copy.deepcopy(item)}]


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_text(items: list[dict]) -> str:
    return "".join(part["text"] for item in items if item["type"] == "reasoning" for part in item["content"])


def _assistant_message(items: list[dict]) -> dict:
    """The output as the chat message that continues the conversation."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    message: dict = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


class _Response:
    """One Responses request: the conversation it continues, the chat request that runs it, its output."""

    def __init__(self, state: ServerState, body: ResponsesRequest):
        self.state, self.body = state, body
        body.check_supported()
        history = self._history()
        messages, origins = body.conversation()
        self.messages = history + messages
        self.origins = ["previous_response_id"] * len(history) + origins
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.sequence = itertools.count()
        self.params = None
        self.chat = self._chat()

    def _history(self) -> list[dict]:
        previous = self.body.previous_response_id
        if previous is None:
            return []
        if self.state.response_store is None:
            raise RequestError(f"previous_response_id: this server does not store responses (start it with "
                               f"{STORE_ENV}=true)", field="previous_response_id")
        stored = self.state.response_store.get(previous)
        if stored is None:
            raise APIError(404, f"previous_response_id: no stored response {previous!r}",
                           param="previous_response_id", code="response_not_found")
        return copy.deepcopy(stored.messages)

    def _chat(self) -> _Chat:
        """The chat request on the conversation; with ``truncation="auto"`` the oldest messages are left out
        until the prompt and ``max_output_tokens`` fit the context."""
        system = [] if self.body.instructions is None else [{"role": "system", "content": self.body.instructions}]
        start = 0
        while True:
            origins = ["instructions"] * len(system) + self.origins[start:]
            try:
                chat = _Chat(self.state, self.body.chat_request(system + copy.deepcopy(self.messages[start:])))
                wanted = len(chat.prompt_ids) + (self.body.max_output_tokens or 1)
                if wanted <= self.state.max_model_len or not self._can_drop(start):
                    return chat
            except RequestError as exc:
                if not (self._can_drop(start) and exc.field == "messages" and "max_model_len" in str(exc)):
                    raise responses_field_names(origins).error(exc) from None
            start += 1
            while start < len(self.messages) - 1 and self.messages[start]["role"] == "tool":
                start += 1  # a tool's output goes with the call it answers

    def _can_drop(self, start: int) -> bool:
        return self.body.truncation == "auto" and start < len(self.messages) - 1

    def engine_requests(self) -> list[NewRequest]:
        try:
            requests = self.chat.engine_requests()
        except RequestError as exc:
            raise responses_field_names(self.origins).error(exc) from None
        self.params = requests[0].params
        return requests

    @property
    def stored(self) -> bool:
        return bool(self.body.store) and self.state.response_store is not None

    def usage(self, out: Optional[RequestOutput], reasoning: str) -> dict:
        output_tokens = len(out.outputs[0].token_ids) if out else 0
        reasoning_tokens = 0
        if reasoning and self.state.tokenizer is not None:
            reasoning_tokens = min(output_tokens, len(self.state.tokenizer.encode(reasoning, add_special_tokens=False)))
        input_tokens = len(self.chat.prompt_ids)
        return {"input_tokens": input_tokens,
                "input_tokens_details": {"cached_tokens": out.num_cached_tokens if out else 0},
                "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": input_tokens + output_tokens}

    def snapshot(self, status: str, output: list[dict], usage: Optional[dict]) -> dict:
        """The response object as it stands."""
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "background": False, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": self.chat.model, "output": output, "usage": usage, "store": self.stored,
                "temperature": self.params.temperature, "top_p": self.params.top_p, **self.body.echo()}

    def finish(self, out: Optional[RequestOutput], items: OutputItems, status: str) -> dict:
        response = self.snapshot(status, items.parts, self.usage(out, _reasoning_text(items.parts)))
        if self.stored:
            self.state.response_store.put(StoredResponse(response, self.messages + [_assistant_message(items.parts)]))
        return response

    def response(self, finals: dict[str, RequestOutput]) -> dict:
        out = finals[self.chat.id]
        choice = out.outputs[0]
        message, _ = self.chat.output.message(choice.text, choice.finish_reason)
        items = OutputItems()
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        items.add_message(message, status)
        return self.finish(out, items, status)

    def event(self, data: dict) -> bytes:
        return sse_event({**data, "sequence_number": next(self.sequence)})

    def error_event(self, api: APIError) -> bytes:
        return self.event({"type": "error", "code": api.code or str(api.status), "message": api.message,
                           "param": api.param})

    stream_end = None  # the Responses stream ends with its last event, not OpenAI chat's "[DONE]"

    async def events(self, stream, tracker: RequestTracker):
        yield self.event({"type": "response.created", "response": self.snapshot("in_progress", [], None)})
        yield self.event({"type": "response.in_progress", "response": self.snapshot("in_progress", [], None)})
        items = OutputItems()
        choice = self.chat.output.stream()
        final, status = None, "completed"
        async for out, completion, delta in chat_deltas(stream, tracker, choice):
            if out.finished:
                final = out
            if completion.finish_reason == "length":
                status = "incomplete"
            for event in items.feed(delta):
                yield self.event(event)
        for event in items.close(status):
            yield self.event(event)
        response = self.finish(final, items, status)
        yield self.event({"type": f"response.{status}", "response": response})


async def create_response(body: ResponsesRequest, request: Request) -> Response:
    return await respond(request, body, _Response)


def _stored(request: Request, response_id: str) -> StoredResponse:
    state: ServerState = request.app.state.server
    stored = state.response_store.get(response_id) if state.response_store is not None else None
    if stored is None:
        hint = "" if state.response_store is not None else f" (this server stores none: {STORE_ENV} is not set)"
        raise APIError(404, f"response_id: no stored response {response_id!r}{hint}", param="response_id",
                       code="response_not_found")
    return stored


async def retrieve_response(response_id: str, request: Request) -> dict:
    return _stored(request, response_id).response


async def delete_response(response_id: str, request: Request) -> dict:
    _stored(request, response_id)
    request.app.state.server.response_store.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
