"""The body of ``POST /v1/responses`` (OpenAI's Responses API) and its translation into a chat request.

A Responses request is a chat completion in another shape: ``instructions`` is the system message, ``input``
the conversation (text messages, the model's earlier function calls and their outputs), ``tools`` flat
function definitions, ``text.format`` the response format and ``max_output_tokens`` the limit.
:meth:`ResponsesRequest.chat_request` builds the :class:`ChatCompletionRequest` that runs it;
:func:`responses_field_names` names the chat fields in errors as the Responses body does.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import Field

from dovetail.errors import RequestError
from dovetail.server.field_names import FieldNames
from dovetail.server.protocol import ChatCompletionRequest, _Body, translated_chat_request

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")


class FunctionTool(_Body):
    """One entry of ``tools``: a function the model may call (the Responses API's flat form)."""

    type: Literal["function"] = "function"
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class FunctionToolChoice(_Body):
    """``tool_choice`` naming the function that must be called."""

    type: Literal["function"] = "function"
    name: str


class TextFormat(_Body):
    """``text.format``: plain ``text``, any JSON object, or JSON following ``schema``."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = Field(default="response", max_length=64)
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class TextConfig(_Body):
    """``text``: the format of the output."""

    format: Optional[TextFormat] = None


class ReasoningConfig(_Body):
    """``reasoning``: accepted for clients that send it; a model reasons as its chat template tells it to
    (``chat_template_kwargs`` switches it where the template can)."""

    effort: Optional[str] = None
    summary: Optional[str] = None


class ResponsesRequest(_Body):
    """``POST /v1/responses``."""

    model: Optional[str] = Field(default=None, description="a served model name (default: the first one)")
    input: Union[str, list[dict[str, Any]]] = Field(
        description="a user message, or a list of items: messages, function calls and function call outputs")
    instructions: Optional[str] = Field(default=None, description="the system message (not carried over by "
                                                                   "previous_response_id)")
    previous_response_id: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], FunctionToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = True
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    stream: Optional[bool] = False
    store: Optional[bool] = True
    background: Optional[bool] = False
    truncation: Optional[Literal["disabled", "auto"]] = "disabled"
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    include: Optional[list[str]] = None
    # vLLM's extra sampling fields.
    top_k: Optional[int] = Field(default=None, ge=-1)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0)
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    seed: Optional[int] = Field(default=None, ge=-(2**63), lt=2**64)
    stop: Union[str, list[str], None] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None

    def check_supported(self) -> None:
        if self.background:
            raise RequestError("background: responses run while the request is open (background mode is not "
                               "supported)", field="background")
        if isinstance(self.input, list) and not self.input:
            raise RequestError("input: the list of items is empty", field="input")

    def conversation(self) -> tuple[list[dict], list[str]]:
        """``input`` as chat messages, and for each message the field it came from."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}], ["input"]
        messages: list[dict] = []
        origins: list[str] = []
        for i, item in enumerate(self.input):
            where = f"input.{i}"
            if not isinstance(item, dict):
                raise RequestError(f"{where}: must be an object (a message, function_call or function_call_output)",
                                   field=where)
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ROLES:
                    raise RequestError(f"{where}.role: must be one of {', '.join(ROLES)} (got {role!r:.40})",
                                       field=f"{where}.role")
                messages.append({"role": ROLES[role], "content": _text_of(item.get("content"), f"{where}.content")})
            elif kind == "function_call":
                call = {"id": _string(item, "call_id", where), "type": "function",
                        "function": {"name": _string(item, "name", where),
                                     "arguments": _arguments(item.get("arguments"), f"{where}.arguments")}}
                if messages and messages[-1]["role"] == "assistant":
                    messages[-1].setdefault("tool_calls", []).append(call)  # the calls of one turn share a message
                    continue
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                                 "content": output if isinstance(output, str) else _text_of(output, f"{where}.output")})
            elif kind == "reasoning":
                continue  # chat templates render earlier turns without their reasoning
            else:
                raise RequestError(f"{where}.type: must be message, function_call, function_call_output or "
                                   f"reasoning (got {kind!r:.40})", field=f"{where}.type")
            origins.append(where)
        return messages, origins

    def chat_request(self, messages: list[dict]) -> ChatCompletionRequest:
        """The chat completion that runs this request on ``messages`` (the system message first)."""
        fmt = self.text.format if self.text is not None else None
        values: dict[str, Any] = dict(
            model=self.model, messages=messages, max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=self.stop,
            parallel_tool_calls=self.parallel_tool_calls, chat_template_kwargs=self.chat_template_kwargs,
            stream=self.stream)
        if self.tools:
            values["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                               for t in self.tools]
        if self.tool_choice is not None:
            values["tool_choice"] = (self.tool_choice if isinstance(self.tool_choice, str)
                                     else {"type": "function", "function": {"name": self.tool_choice.name}})
        if fmt is not None and fmt.type != "text":
            schema = {"name": fmt.name, "description": fmt.description, "schema": fmt.json_schema,
                      "strict": fmt.strict} if fmt.type == "json_schema" else None
            values["response_format"] = {"type": fmt.type, "json_schema": schema}
        return translated_chat_request(values)

    def echo(self) -> dict:
        """The request's settings as a response object repeats them."""
        fmt = self.text.format if self.text is not None and self.text.format is not None else TextFormat()
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "parallel_tool_calls": self.parallel_tool_calls is not False,
                "previous_response_id": self.previous_response_id,
                "reasoning": self.reasoning.model_dump() if self.reasoning else None,
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
                "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
                "tools": [t.model_dump() for t in self.tools or []], "truncation": self.truncation or "disabled",
                "metadata": self.metadata or {}, "user": self.user}


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise RequestError(f"{where}.{key}: required, a non-empty string", field=f"{where}.{key}")
    return value


def _arguments(value, where: str) -> str:
    if not isinstance(value, str):
        raise RequestError(f"{where}: required, the call's arguments as a JSON string", field=where)
    try:
        json.loads(value) if value.strip() else None
    except ValueError:
        raise RequestError(f"{where}: not valid JSON", field=where) from None
    return value


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: must be a string or a list of text parts", field=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}.{j}: only text parts ({', '.join(TEXT_PARTS)}) are supported "
                               f"(got type {kind!r:.40})", field=f"{where}.{j}")
        texts.append(part["text"])
    return "\n".join(texts)


def responses_field_names(origins: list[str]) -> FieldNames:
    """The Responses body's names of the chat fields a request translates into."""
    return FieldNames({"response_format.json_schema.schema": "text.format.schema", "response_format": "text.format",
                       "max_completion_tokens": "max_output_tokens"}, "parameters", origins, "input")
