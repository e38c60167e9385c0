"""Errors of a request that runs as a chat completion, named by the fields of the body the client sent.

The Responses and Anthropic Messages endpoints translate their bodies into a chat completion; the chat path
names its own fields in errors (``max_completion_tokens``, ``messages.3.content``). :class:`FieldNames`
turns those back into the client's (``max_output_tokens``, ``input.2.content``).
"""

from __future__ import annotations

import re

from dovetail.errors import RequestError

_TOOL_FIELD = re.compile(r"\btools\.(\d+)\.function\.parameters\b")
_MESSAGE_FIELD = re.compile(r"\bmessages(?:\.(\d+)((?:\.[\w]+)*))?")


class FieldNames:
    """How the chat fields of one translated request are called in its own body.

    ``renames``: chat field -> the body's; ``tool_parameters``: the body's name of a tool's JSON schema;
    ``origins``: for each chat message, the body field it came from (``input.2``, ``system``); ``messages``:
    the body's name of the conversation as a whole.
    """

    def __init__(self, renames: dict[str, str], tool_parameters: str, origins: list[str], messages: str):
        self.renames = renames
        self.tool_parameters = tool_parameters
        self.origins = origins
        self.messages = messages
        self._renamed = re.compile(r"(?<![\w.])(%s)(?![\w])" % "|".join(map(re.escape, renames))) if renames else None

    def _rename(self, text: str) -> str:
        if self._renamed is not None:
            text = self._renamed.sub(lambda m: self.renames[m.group(1)], text)
        text = _TOOL_FIELD.sub(lambda m: f"tools.{m.group(1)}.{self.tool_parameters}", text)
        return _MESSAGE_FIELD.sub(self._message, text)

    def _message(self, match: re.Match) -> str:
        index, rest = match.group(1), match.group(2) or ""
        if index is None or int(index) >= len(self.origins):
            return self.messages
        origin = self.origins[int(index)]
        return origin + rest if origin.startswith(f"{self.messages}.") else origin

    def error(self, exc: RequestError) -> RequestError:
        """``exc`` with its field, and the chat fields its message names, as the body calls them."""
        if exc.field is None:
            return exc
        return RequestError(self._rename(str(exc)), field=self._rename(exc.field))
