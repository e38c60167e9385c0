"""The body of ``POST /v1/messages`` (Anthropic's Messages API) and its translation into a chat request.

``system`` becomes the system message and ``messages`` the conversation: text blocks are the text,
an assistant's ``tool_use`` blocks its tool calls, and a user's ``tool_result`` blocks the ``tool`` messages
answering them. ``tools`` (``name``, ``description``, ``input_schema``), ``tool_choice`` (``auto``, ``any``,
``tool``, ``none``), ``stop_sequences`` and ``output_config.format`` (a JSON schema) map to their chat
counterparts. A conversation that ends with an
assistant turn is continued, not answered.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import Field

from dovetail.errors import RequestError
from dovetail.server.field_names import FieldNames
from dovetail.server.protocol import ChatCompletionRequest, _Body, translated_chat_request

#: Blocks that carry no text the model should read again (an earlier turn's thinking).
SKIPPED_BLOCKS = ("thinking", "redacted_thinking")


class AnthropicTool(_Body):
    """One entry of ``tools``: a client tool (the model's calls come back as ``tool_use`` blocks)."""

    type: Optional[Literal["custom"]] = None
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(_Body):
    """``tool_choice``: ``auto``, ``any`` (some tool), ``tool`` (the one named) or ``none``."""

    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class JSONOutputFormat(_Body):
    """``output_config.format``: JSON following ``schema``."""

    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    """``output_config``: the output's ``format``; ``effort`` is accepted (a model reasons as its template says)."""

    format: Optional[JSONOutputFormat] = None
    effort: Optional[str] = None


class ThinkingConfig(_Body):
    """``thinking``: accepted for clients that send it; a model thinks as its chat template tells it to
    (``chat_template_kwargs`` switches it where the template can)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = None


class MessagesBody(_Body):
    """The conversation part of a Messages request (all ``/v1/messages/count_tokens`` takes)."""

    model: Optional[str] = Field(default=None, description="a served model name (default: the first one)")
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: Union[str, list[dict[str, Any]], None] = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    thinking: Optional[ThinkingConfig] = None
    chat_template_kwargs: Optional[dict[str, Any]] = Field(
        default=None, description="vLLM's: extra variables for the chat template")

    def conversation(self) -> tuple[list[dict], list[str]]:
        """The chat messages, and for each the field it came from."""
        messages: list[dict] = []
        origins: list[str] = []
        if self.system is not None:
            system = self.system if isinstance(self.system, str) else _text_of(self.system, "system")
            if system:
                messages.append({"role": "system", "content": system})
                origins.append("system")
        for i, message in enumerate(self.messages):
            where = f"messages.{i}"
            role = message.get("role") if isinstance(message, dict) else None
            if role not in ("user", "assistant"):
                raise RequestError(f"{where}.role: must be user or assistant (got {role!r:.40})", field=f"{where}.role")
            content = message.get("content")
            if isinstance(content, str):
                messages.append({"role": role, "content": content})
                origins.append(where)
                continue
            if not isinstance(content, list):
                raise RequestError(f"{where}.content: must be a string or a list of content blocks",
                                   field=f"{where}.content")
            for entry in (_assistant(content, where) if role == "assistant" else _user(content, where)):
                messages.append(entry)
                origins.append(where)
        return messages, origins

    def continues_assistant(self) -> bool:
        """Whether the conversation ends with an assistant turn, which the output continues."""
        return self.messages[-1].get("role") == "assistant"

    def chat_request(self, messages: list[dict], max_tokens: Optional[int] = None, **sampling) -> ChatCompletionRequest:
        """The chat completion that runs this request on ``messages``."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.continues_assistant():
            kwargs["continue_final_message"] = True
        values: dict[str, Any] = dict(model=self.model, messages=messages, max_completion_tokens=max_tokens,
                                      chat_template_kwargs=kwargs or None, **sampling)
        if self.continues_assistant():
            values["add_generation_prompt"] = False
        if self.tools:
            values["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.input_schema}} for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool":
                if not choice.name:
                    raise RequestError("tool_choice.name: required when type is 'tool'", field="tool_choice.name")
                values["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                values["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
            if choice.disable_parallel_tool_use:
                values["parallel_tool_calls"] = False
        return translated_chat_request(values)


class MessagesRequest(MessagesBody):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = Field(default=None, ge=0.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=-1)
    stream: Optional[bool] = False
    metadata: Optional[dict[str, Any]] = None
    output_config: Optional[OutputConfig] = None

    def chat(self, messages: list[dict]) -> ChatCompletionRequest:
        fmt = self.output_config.format if self.output_config is not None else None
        sampling = dict(stop=self.stop_sequences, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                        stream=self.stream, user=_user_id(self.metadata),
                        response_format=None if fmt is None else {
                            "type": "json_schema", "json_schema": {"name": "output", "schema": fmt.json_schema}})
        return self.chat_request(messages, self.max_tokens, **sampling)


def _user_id(metadata: Optional[dict]) -> Optional[str]:
    user = (metadata or {}).get("user_id")
    return user if isinstance(user, str) else None


def anthropic_field_names(origins: list[str]) -> FieldNames:
    """The Messages body's names of the chat fields a request translates into."""
    return FieldNames({"response_format.json_schema.schema": "output_config.format.schema",
                       "response_format": "output_config.format", "max_completion_tokens": "max_tokens",
                       "stop": "stop_sequences"}, "input_schema", origins, "messages")


def _blocks(content: list, where: str):
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        yield f"{where}.content.{j}", kind, block


def _text(block: dict, at: str) -> str:
    if not isinstance(block.get("text"), str):
        raise RequestError(f"{at}.text: required, a string", field=f"{at}.text")
    return block["text"]


def _text_of(blocks: list, where: str) -> str:
    texts = []
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise RequestError(f"{at}.type: only text blocks are supported here (got {kind!r:.40})", field=f"{at}.type")
        texts.append(_text(block, at))
    return "\n".join(texts)


def _user(content: list, where: str) -> list[dict]:
    """A user turn: a ``tool`` message per ``tool_result`` block, then its text."""
    entries, texts = [], []
    for at, kind, block in _blocks(content, where):
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_result":
            tool_use_id = block.get("tool_use_id")
            if not isinstance(tool_use_id, str) or not tool_use_id:
                raise RequestError(f"{at}.tool_use_id: required, a non-empty string", field=f"{at}.tool_use_id")
            result = block.get("content", "")
            text = result if isinstance(result, str) else _text_of(result, f"{at}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            entries.append({"role": "tool", "tool_call_id": tool_use_id, "content": text})
        elif kind not in SKIPPED_BLOCKS:
            raise RequestError(f"{at}.type: must be text or tool_result in a user turn (got {kind!r:.40})",
                               field=f"{at}.type")
    if texts or not entries:
        entries.append({"role": "user", "content": "\n".join(texts)})
    return entries


def _assistant(content: list, where: str) -> list[dict]:
    """An assistant turn: its text and its ``tool_use`` blocks as tool calls."""
    texts, calls = [], []
    for at, kind, block in _blocks(content, where):
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            name, call_id, arguments = block.get("name"), block.get("id"), block.get("input", {})
            if not isinstance(name, str) or not name or not isinstance(call_id, str) or not call_id:
                raise RequestError(f"{at}: a tool_use block needs an id and a name", field=at)
            if not isinstance(arguments, dict):
                raise RequestError(f"{at}.input: must be an object", field=f"{at}.input")
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
        elif kind not in SKIPPED_BLOCKS:
            raise RequestError(f"{at}.type: must be text, tool_use or thinking in an assistant turn (got "
                               f"{kind!r:.40})", field=f"{at}.type")
    message: dict = {"role": "assistant", "content": "".join(texts) if texts else (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return [message]
