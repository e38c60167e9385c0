"""Tool-call parsers (vLLM's ``--tool-call-parser``): the model's text to OpenAI ``tool_calls``.

Each parser reads one model family's format and returns, for the output so far,
the plain content and the tool calls in it. A call is a :class:`PartialCall`: its
name once complete, and its arguments' raw JSON text as far as it can already be
sent (a stream never takes back what it sent, so a closing brace that may belong
to the call's own object is held back until the call is complete). The whole-text
answer and the stream are both built from that one reading.

- ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, after optional content;
- ``llama3_json`` (Llama 3.1+): the output is one or more ``{"name": ..., "parameters": {...}}``
  objects separated by ``;``, optionally after ``<|python_tag|>``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` objects, or (newer
  tokenizers) ``[TOOL_CALLS]name[ARGS]{...}`` per call;
- ``qwen3_coder`` (Qwen3-Coder): ``<function=name><parameter=p>value</parameter></function>`` blocks
  (:mod:`dovetail.server.tool_parser_xml`).
"""

from __future__ import annotations

import json
import secrets
import string

from dovetail.server.tool_parser_base import (JSON_DECODER, PartialCall, Reading, ToolParser, held_prefix, read_object,
                                              read_objects)
from dovetail.server.tool_parser_xml import Qwen3CoderToolParser


class HermesToolParser(ToolParser):
    """``<tool_call>{...}</tool_call>`` blocks (Qwen2.5, Qwen3, Hermes 2 Pro)."""

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def read(self, text: str, final: bool) -> Reading:
        first = text.find(self.start)
        if first == -1:
            return Reading(text if final else text[:len(text) - held_prefix(text, self.start)])
        calls = []
        for block in text[first:].split(self.start)[1:]:
            body, closed, _ = block.partition(self.end)
            if not closed and not final:
                body = body[:len(body) - held_prefix(body, self.end)]
            body = body.strip()
            if body:
                calls.append(read_object(body, final=final or bool(closed)))
        return Reading(text[:first], calls)


class Llama3JsonToolParser(ToolParser):
    """JSON objects separated by ``;``, optionally after ``<|python_tag|>`` (Llama 3.1 and later)."""

    name = "llama3_json"
    tag = "<|python_tag|>"

    def read(self, text: str, final: bool) -> Reading:
        body = text.lstrip()
        if body.startswith(self.tag):
            body = body[len(self.tag):]
        elif not final and self.tag.startswith(body):
            return Reading("")  # may still become the tag
        if not final and not body.strip():
            return Reading("")  # the first call has not begun
        if not body.lstrip().startswith("{"):
            return Reading(text)
        calls, stopped = read_objects(body, ";", ("parameters", "arguments"), final)
        if final and body[stopped:].strip():
            return Reading(text)  # not tool calls after all
        return Reading("", calls)


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS]`` and a JSON list of calls, or ``[TOOL_CALLS]name[ARGS]{...}`` per call."""

    name = "mistral"
    tag, args_tag = "[TOOL_CALLS]", "[ARGS]"

    def read(self, text: str, final: bool) -> Reading:
        first = text.find(self.tag)
        if first == -1:
            return Reading(text if final else text[:len(text) - held_prefix(text, self.tag)])
        region = text[first + len(self.tag):]
        stripped = region.lstrip()
        if stripped.startswith("["):
            calls, _ = read_objects(stripped[1:], ",", ("arguments", "parameters"), final)
        elif stripped.startswith("{"):
            calls, _ = read_objects(stripped, ",", ("arguments", "parameters"), final)
        else:
            calls = [self._named(part, final) for part in region.split(self.tag)]
            calls = [c for c in calls if c is not None]
        return Reading(text[:first], calls)

    def _named(self, part: str, final: bool) -> PartialCall | None:
        name, found, args = part.partition(self.args_tag)
        if not found:
            return None
        try:
            _, end = JSON_DECODER.raw_decode(args.lstrip())
            return PartialCall(name.strip(), args.strip()[:end], True)
        except ValueError:
            return PartialCall(name.strip(), args.strip(), False)

    def new_call_id(self) -> str:
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))  # Mistral's templates want 9 characters


class RequiredToolParser(ToolParser):
    """The JSON list of ``{"name", "parameters"}`` that ``tool_choice="required"`` constrains output to."""

    name = "required"

    def read(self, text: str, final: bool) -> Reading:
        stripped = text.lstrip()
        if not stripped.startswith("["):
            return Reading("")
        calls, _ = read_objects(stripped[1:], ",", ("parameters", "arguments"), final)
        return Reading("", calls)


class NamedToolParser(ToolParser):
    """A named ``tool_choice``: the whole output is the arguments of that function."""

    name = "named"

    def __init__(self, function: str):
        super().__init__()
        self.function = function

    def read(self, text: str, final: bool) -> Reading:
        complete = True
        try:
            JSON_DECODER.raw_decode(text.strip())
        except ValueError:
            complete = False
        return Reading("", [PartialCall(self.function, text, complete or final)])


TOOL_PARSERS = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, Qwen3CoderToolParser)}


def tool_parser_names() -> list[str]:
    return sorted(TOOL_PARSERS)


def get_tool_parser(name: str, tools=None) -> ToolParser:
    """A new parser of format ``name`` for a request with ``tools``."""
    return TOOL_PARSERS[name](tools)


def final_calls(parser: ToolParser, text: str) -> tuple[str | None, list[dict]] | None:
    """``(content, tool_calls)`` of a whole output, the calls in OpenAI's form with arguments as a compact
    JSON string; None when the output holds no valid tool call (it is all content then)."""
    reading = parser.read(text, final=True)
    calls = []
    for call in reading.calls:
        try:
            arguments = json.loads(call.arguments) if call.arguments.strip() else {}
        except ValueError:
            return None
        if not call.name:
            return None
        calls.append({"id": parser.new_call_id(), "type": "function",
                      "function": {"name": call.name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
    if not calls:
        return None
    return reading.content or None, calls


class ToolCallStream:
    """Turns the growing output into OpenAI's streamed deltas: content, then per call a first delta with its
    id, type and name, then pieces of its arguments."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.sent_content = 0
        self.ids: list[str] = []
        self.sent_arguments: list[int] = []

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def update(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """``(content delta, tool-call deltas)`` for the output ``text`` so far."""
        reading = self.parser.read(text, final)
        content = reading.content[self.sent_content:]
        self.sent_content = max(self.sent_content, len(reading.content))
        deltas = []
        for index, call in enumerate(reading.calls):
            delta: dict = {"index": index}
            if index == len(self.ids):
                if not call.name:
                    break  # calls are announced in order, each once its name is known
                self.ids.append(self.parser.new_call_id())
                self.sent_arguments.append(0)
                delta.update(id=self.ids[index], type="function", function={"name": call.name, "arguments": ""})
            piece = call.arguments[self.sent_arguments[index]:]
            if piece:
                self.sent_arguments[index] = len(call.arguments)
                delta.setdefault("function", {})["arguments"] = piece
            if len(delta) > 1:
                deltas.append(delta)
        return content, deltas
