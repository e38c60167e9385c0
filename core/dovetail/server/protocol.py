"""Request bodies of the OpenAI-compatible API (OpenAI's fields plus vLLM's sampling extras).

Types and ranges live here so that the OpenAPI schema documents them and a
wrong value is rejected with the field's name; :meth:`SamplingFields.sampling_params`
turns a request into :class:`dovetail.SamplingParams`.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, StrictInt, Tag, ValidationError, field_validator,
                      model_validator)

from dovetail.errors import RequestError
from dovetail.sampling_params import SamplingParams, StructuredOutputsParams

MAX_LOGPROBS = 20
TokenIds = list[int]


logger = logging.getLogger("dovetail")
#: (body, field) pairs already reported as ignored: each is logged once per process.
_IGNORED_FIELDS: set[tuple[str, str]] = set()


class _Body(BaseModel):
    """A request body (or part of one). Fields it does not define are ignored, as OpenAI clients send ones we do
    not use (e.g. ``store``, ``metadata``), and each such field name is logged once, with a warning."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _log_ignored_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            for name in data.keys() - known:
                if (cls.__name__, str(name)) not in _IGNORED_FIELDS:
                    _IGNORED_FIELDS.add((cls.__name__, str(name)))
                    logger.warning("request field %r is not supported by %s and is ignored (logged once)",
                                   str(name), cls.__name__)
        return data


class StreamOptions(_Body):
    """``stream_options``: ``include_usage`` adds a last chunk with the token counts."""

    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """``response_format.json_schema``: a named JSON schema the output must follow."""

    name: str = Field(default="response", max_length=64)
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Body):
    """``response_format``: plain ``text``, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: Optional[JsonSchemaFormat] = None


class SamplingFields(_Body):
    """Fields shared by completions and chat completions."""

    model: Optional[str] = Field(default=None, description="a served model name (default: the first one)")
    n: Optional[int] = Field(default=None, ge=1, le=1024)
    temperature: Optional[float] = Field(default=None, ge=0.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    seed: Optional[int] = Field(default=None, ge=-(2**63), lt=2**64)
    stop: Union[str, list[str], None] = None
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    # vLLM's extra sampling fields.
    top_k: Optional[int] = Field(default=None, ge=-1)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0)
    ignore_eos: Optional[bool] = False
    min_tokens: Optional[int] = Field(default=None, ge=0)
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: Optional[bool] = False
    skip_special_tokens: Optional[bool] = True
    spaces_between_special_tokens: Optional[bool] = True
    # Structured outputs (see dovetail.server.structured): OpenAI's response_format and vLLM's fields.
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[dict[str, Any]] = Field(
        default=None, description="vLLM's StructuredOutputsParams: one of json, regex, choice, grammar, json_object")
    guided_json: Union[str, dict[str, Any], None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    guided_decoding_backend: Optional[str] = Field(default=None, description="accepted and ignored (always xgrammar)")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options: only allowed when stream is true", field="stream_options")

    def _logit_bias(self) -> Optional[dict[int, float]]:
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise RequestError(f"logit_bias: key {key!r} is not a token id", field="logit_bias") from None
            bias[token] = value
        return bias

    def sampling_params(self, max_tokens: int, logprobs: Optional[int], prompt_logprobs: Optional[int] = None,
                        structured_outputs: Optional[StructuredOutputsParams] = None,
                        defaults: Optional[dict[str, Any]] = None) -> SamplingParams:
        """The engine's parameters; an unset field takes ``defaults``' value (the model's generation config),
        else SamplingParams' default."""
        if self.min_tokens is not None and self.min_tokens > max_tokens:
            raise RequestError(f"min_tokens: {self.min_tokens} is more than max_tokens ({max_tokens})",
                               field="min_tokens")
        values: dict[str, Any] = dict(
            n=self.n, temperature=self.temperature, top_p=self.top_p, seed=self.seed, stop=self.stop,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias=self._logit_bias(), top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            structured_outputs=structured_outputs)
        for key, value in (defaults or {}).items():
            if values.get(key) is None:
                values[key] = value
        return SamplingParams(**{k: v for k, v in values.items() if v is not None})


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt_kind(value) -> Optional[str]:
    """The shape of a ``prompt`` by its first element, so that pydantic checks every element against that
    shape alone (trying each shape of the union on a list of millions of token ids took seconds)."""
    if isinstance(value, str):
        return "str"
    if not isinstance(value, list) or not value:
        return None
    first = value[0]
    if isinstance(first, str):
        return "list[str]"
    if _is_token_id(first):
        return "list[int]"
    return "list[list[int]]" if isinstance(first, list) else None


#: A completions prompt: text, texts, token ids or lists of token ids (none of them empty).
Prompt = Annotated[
    Union[Annotated[str, Tag("str")], Annotated[list[str], Tag("list[str]")],
          Annotated[list[StrictInt], Tag("list[int]")],
          Annotated[list[Annotated[list[StrictInt], Field(min_length=1)]], Tag("list[list[int]]")]],
    Discriminator(_prompt_kind, custom_error_type="prompt_shape", custom_error_message=(
        "must be a string, a list of strings, a list of token ids or a list of lists of token ids (none of them "
        "empty)"))]


def _not_empty(value, what: str):
    if isinstance(value, list) and not value:
        raise ValueError(f"{what} is empty")
    return value


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: Prompt = Field(
        description="a string, a list of strings, a list of token ids, or a list of lists of token ids")
    max_tokens: Optional[int] = Field(default=None, ge=1, description="default 16 (less if the context is full)")
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: Optional[bool] = False
    best_of: Optional[int] = Field(default=None, ge=1)
    suffix: Optional[str] = None
    add_special_tokens: Optional[bool] = True

    _prompt_not_empty = field_validator("prompt", mode="before")(lambda value: _not_empty(value, "the prompt"))


class PoolingInputs(_Body):
    """The inputs of a pooling model's request (``/v1/embeddings``, ``/classify``): OpenAI's ``input``."""

    model: Optional[str] = Field(default=None, description="a served model name (default: the first one)")
    input: Prompt = Field(description="a string, a list of strings, a list of token ids, or a list of lists of "
                                      "token ids")
    user: Optional[str] = None
    add_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = Field(
        default=None, ge=-1, description="keep only each input's last k tokens (-1: as many as max_model_len)")

    _input_not_empty = field_validator("input", mode="before")(lambda value: _not_empty(value, "the input"))


class EmbeddingRequest(PoolingInputs):
    """``POST /v1/embeddings``."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(default=None, ge=1, description="keep the first N values (Matryoshka models)")
    normalize: Optional[bool] = Field(default=None, description="L2-normalise (default: the pooler's setting)")


class ClassificationRequest(PoolingInputs):
    """``POST /classify``: a sequence classifier's probabilities for each input."""


class ScoreRequest(_Body):
    """``POST /score``: a cross-encoder's relevance score of each pair (one ``text_1`` against every
    ``text_2``, or the two lists pair by pair)."""

    model: Optional[str] = Field(default=None, description="a served model name (default: the first one)")
    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]
    user: Optional[str] = None


class RerankRequest(_Body):
    """``POST /rerank`` (Jina's and Cohere's shape): the documents ordered by relevance to the query."""

    model: Optional[str] = Field(default=None, description="a served model name (default: the first one)")
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int = Field(default=0, ge=0, description="how many of the best to return (0: all)")
    user: Optional[str] = None


class ContentPart(_Body):
    """One part of a message's content; only ``text`` parts are supported."""

    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None

    def text(self, index: int) -> Optional[str]:
        if not isinstance(self.content, list):
            return self.content
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise RequestError(f"messages.{index}.content: only text parts are supported "
                                   f"(got type {part.type!r})", field=f"messages.{index}.content")
        return "\n".join(part.text for part in self.content)


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template expects them (text content; extra keys such as tool calls kept)."""
    result = []
    for i, message in enumerate(messages):
        entry = dict(message.model_extra or {})
        entry.update(role=message.role, content=message.text(i))
        if message.name is not None:
            entry["name"] = message.name
        result.append(entry)
    return result


class FunctionDefinition(_Body):
    """A function the model may call: its name and the JSON schema of its arguments."""

    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ChatTool(_Body):
    """One entry of ``tools``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Body):
    """The ``function`` of a ``tool_choice`` that names one: its ``name``."""

    name: str


class NamedToolChoice(_Body):
    """``tool_choice`` naming the function that must be called."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(default=None, ge=1, description="deprecated: use max_completion_tokens")
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list[ChatTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = Field(
        default=None, description="default: auto when tools are given, else none")
    parallel_tool_calls: Optional[bool] = True
    add_generation_prompt: Optional[bool] = True
    chat_template_kwargs: Optional[dict[str, Any]] = Field(
        default=None, description="extra variables for the chat template, e.g. {\"enable_thinking\": false}")
    include_reasoning: Optional[bool] = Field(default=True, description="with a reasoning parser: return "
                                              "the reasoning as reasoning_content (false: drop it)")

    def check_supported(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs: set logprobs to true to use top_logprobs", field="top_logprobs")

    def conversation(self) -> list[dict[str, Any]]:
        return conversation(self.messages)


def translated_chat_request(values: dict[str, Any]) -> ChatCompletionRequest:
    """The chat completion another API's body translates into (its None values left unset); a value the chat
    request cannot take is a :class:`RequestError` naming the chat field (for the caller to rename), never a
    server error."""
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in values.items() if v is not None})
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error.get("loc", ())) or "body"
        raise RequestError(f"{field}: {error.get('msg', 'invalid value')}", field=field) from None


class TokenizeRequest(_Body):
    """``POST /tokenize``: a ``prompt`` or chat ``messages`` (rendered with the chat template)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = True
    add_generation_prompt: Optional[bool] = True
    return_token_strs: Optional[bool] = False
    tools: Optional[list[ChatTool]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class DetokenizeRequest(_Body):
    """``POST /detokenize``."""

    model: Optional[str] = None
    tokens: TokenIds


class LoadLoRAAdapterRequest(_Body):
    """``POST /v1/load_lora_adapter`` (vLLM's): serve the PEFT adapter at ``lora_path`` as model ``lora_name``."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Body):
    """``POST /v1/unload_lora_adapter`` (vLLM's): stop serving model ``lora_name`` (an adapter)."""

    lora_name: str = Field(min_length=1)
