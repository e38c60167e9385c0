"""What every tool-call parser is made of: a call as far as it has been generated (:class:`PartialCall`),
what an output holds so far (:class:`Reading`), the :class:`ToolParser` interface, and readers of JSON calls
that may still be incomplete."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

JSON_DECODER = json.JSONDecoder()
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_WHITESPACE = " \t\r\n"


@dataclass
class PartialCall:
    """One tool call as far as it has been generated."""

    name: str | None
    #: The arguments' JSON text that may be sent now (all of it once ``complete``).
    arguments: str
    complete: bool


@dataclass
class Reading:
    """What an output holds so far: content that may be shown, and tool calls."""

    content: str
    calls: list[PartialCall] = field(default_factory=list)


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (it may still become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def read_object(text: str, args_keys: tuple[str, ...] = ("arguments", "parameters"),
                final: bool = False) -> PartialCall:
    """The call in the raw JSON object ``text`` (which may be incomplete, unless ``final``)."""
    try:
        obj, _ = JSON_DECODER.raw_decode(text)
        complete = isinstance(obj, dict)
    except ValueError:
        obj, complete = None, False
    key = re.search(r'"(%s)"\s*:\s*' % "|".join(map(re.escape, args_keys)), text)
    if complete:
        name = obj.get("name") if isinstance(obj.get("name"), str) else None
    else:  # only a name before the arguments is surely the call's (one inside them is not)
        found = _NAME.search(text, 0, key.start() if key else len(text))
        name = json.loads(f'"{found.group(1)}"') if found else None
    if key is None:
        return PartialCall(name, "{}" if complete else "", complete)
    start = key.end()
    try:
        _, end = JSON_DECODER.raw_decode(text, start)
        return PartialCall(name, text[start:end], complete)
    except ValueError:
        pass
    arguments = text[start:]
    if not final:
        arguments = arguments.rstrip(_WHITESPACE + "}")  # the call's own closing brace may be among them
    return PartialCall(name, arguments, complete)


def read_objects(text: str, separators: str, args_keys: tuple[str, ...], final: bool) -> tuple[list[PartialCall], int]:
    """Consecutive JSON objects separated by whitespace and ``separators``; stops at anything else.
    Returns the calls and where reading stopped."""
    calls, pos = [], 0
    while True:
        while pos < len(text) and text[pos] in _WHITESPACE + separators:
            pos += 1
        if pos >= len(text) or text[pos] != "{":
            return calls, pos
        try:
            _, end = JSON_DECODER.raw_decode(text, pos)
        except ValueError:
            calls.append(read_object(text[pos:], args_keys, final))
            return calls, len(text)
        calls.append(read_object(text[pos:end], args_keys, final))
        pos = end


class ToolParser:
    """Reads one model family's tool calls from the text generated so far.

    ``tools`` are the request's (``ChatTool`` objects), for formats whose arguments are typed by the tools'
    schemas; the others ignore them.
    """

    name = ""

    def __init__(self, tools=None):
        self.tools = tools or []

    def read(self, text: str, final: bool) -> Reading:
        raise NotImplementedError

    def new_call_id(self) -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"
