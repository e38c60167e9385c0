"""A chat choice's text as the assistant's message: reasoning, content and tool calls, whole or streamed.

The reasoning parser (if the server has one) takes the reasoning off the front
of the text; the tool parser (if the request's tool choice has one) reads the
rest into tool calls. A choice that called tools and stopped finishes with
``tool_calls``, as OpenAI's do. A stream sends the same split as deltas:
``reasoning_content``, ``content`` and ``tool_calls`` (a first delta per call
with its id, type and name, then pieces of its arguments).
"""

from __future__ import annotations

from typing import Optional

from dovetail.reasoning import ReasoningParser
from dovetail.server.tool_parsers import ToolCallStream, ToolParser, final_calls


class ChatOutput:
    """How one request's choices become messages."""

    def __init__(self, reasoning: Optional[ReasoningParser], prompt_token_ids: list[int],
                 tool_parser: Optional[ToolParser], include_reasoning: bool = True):
        self.reasoning = reasoning
        self.prompt_opens = reasoning is not None and reasoning.prompt_opens_reasoning(prompt_token_ids)
        self.tool_parser = tool_parser
        self.include_reasoning = include_reasoning

    @property
    def plain(self) -> bool:
        """Whether the text is the content as it is."""
        return self.reasoning is None and self.tool_parser is None

    def message(self, text: str, finish_reason: Optional[str]) -> tuple[dict, Optional[str]]:
        """The assistant message of a finished choice, and its finish reason."""
        message: dict = {"role": "assistant"}
        content: Optional[str] = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(text, self.prompt_opens)
            message["reasoning_content"] = reasoning if self.include_reasoning else None
        calls = final_calls(self.tool_parser, content or "") if self.tool_parser is not None else None
        if calls is not None:
            content, tool_calls = calls
            message["tool_calls"] = tool_calls
            if finish_reason == "stop" and self.tool_parser.name != "named":
                finish_reason = "tool_calls"  # a forced function finishes with stop, as in OpenAI's API
        message["content"] = content
        return message, finish_reason

    def stream(self) -> "ChoiceStream":
        return ChoiceStream(self)


class ChoiceStream:
    """One streamed choice: takes each piece of new text and gives the delta to send."""

    def __init__(self, output: ChatOutput):
        self.output = output
        self.text = ""
        self.content = ""
        self.reasoning = output.reasoning.stream(output.prompt_opens) if output.reasoning is not None else None
        self.tools = ToolCallStream(output.tool_parser) if output.tool_parser is not None else None

    @property
    def called_tools(self) -> bool:
        return self.tools is not None and self.tools.called

    def delta(self, new_text: str, final: bool, new_tokens: bool = True) -> dict:
        """The delta for ``new_text`` (empty when there is nothing to send yet)."""
        if self.output.plain:
            return {"content": new_text} if new_text or new_tokens or not final else {}
        self.text += new_text
        delta: dict = {}
        content_piece = new_text
        if self.reasoning is not None:
            reasoning_piece, content_piece = self.reasoning.update(self.text, final)
            if reasoning_piece and self.output.include_reasoning:
                delta["reasoning_content"] = reasoning_piece
        if self.tools is None:
            if content_piece:
                delta["content"] = content_piece
            return delta
        self.content += content_piece
        content_piece, calls = self.tools.update(self.content, final)
        if content_piece:
            delta["content"] = content_piece
        if calls:
            delta["tool_calls"] = calls
        return delta

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        if reason == "stop" and self.called_tools and self.output.tool_parser.name != "named":
            return "tool_calls"
        return reason
