"""What every endpoint shares: the engine loop, a tokenizer, the served names and the metrics."""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from dovetail.engine.async_engine import AsyncLLMEngine
from dovetail.engine.prompt_tokenizer import PromptTokenizer
from dovetail.errors import RequestError
from dovetail.lora.request import LoRARequest
from dovetail.server.errors import APIError
from dovetail.server.metrics import ServerMetrics
from dovetail.server.response_store import ResponseStore


#: Arguments of ``apply_chat_template`` that ``chat_template_kwargs`` may not override.
RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tools", "documents", "tokenize", "add_generation_prompt",
                            "chat_template", "return_dict", "return_tensors", "padding", "truncation"}


@dataclass
class ServerSettings:
    """Options of the HTTP layer (the engine's own live in :class:`dovetail.config.EngineConfig`)."""

    served_model_names: list[str]
    api_key: Optional[str] = None
    max_body_bytes: int = 32 * 1024 * 1024
    #: Completions' ``max_tokens`` when the request gives none (OpenAI's default).
    default_completion_max_tokens: int = 16
    #: The most sequences (``n`` times the number of prompts) one request may ask for (400 beyond).
    max_sequences_per_request: int = 256
    #: Host header values answered (``--allowed-hosts``); None answers any.
    allowed_hosts: Optional[list[str]] = None
    #: The parser of ``tool_choice="auto"`` calls (``--enable-auto-tool-choice --tool-call-parser``), or None.
    tool_call_parser: Optional[str] = None
    #: The chat template used in place of the tokenizer's (``--chat-template``), or None.
    chat_template: Optional[str] = None
    #: LoRA adapters served as models of their own (``--lora-modules``), by name.
    lora_modules: dict[str, LoRARequest] = field(default_factory=dict)
    #: Report the prompt tokens the prefix cache held in ``usage.prompt_tokens_details.cached_tokens``
    #: (``--enable-prompt-tokens-details``, vLLM's).
    enable_prompt_tokens_details: bool = False

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        """A chat or completions ``usage`` object."""
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        if self.enable_prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        return usage


@dataclass
class ServerState:
    """The engine loop and what the HTTP layer needs to prepare requests for it."""

    engine: AsyncLLMEngine
    settings: ServerSettings
    metrics: ServerMetrics
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    model_path: str
    created: int = 0
    #: The engine's reasoning parser (``--reasoning-parser``), or None.
    reasoning: Any = None
    #: Tokenises request text: the character bound first, errors named by field (built from ``tokenizer``).
    prompt_tokenizer: Optional[PromptTokenizer] = None
    #: Where requests are prepared (chat template, tokenisation), so that a long prompt never holds the event loop.
    preparer: Optional[ThreadPoolExecutor] = None
    #: The sampling fields a request that sets none of them gets (the engine's ``default_sampling``).
    default_sampling: dict[str, Any] = field(default_factory=dict)
    #: A sequence classifier's label names (``id2label``), or None for other models.
    classifier_labels: Optional[list[str]] = None
    #: Finished ``/v1/responses`` kept for retrieval and ``previous_response_id``, or None (not stored).
    response_store: Optional[ResponseStore] = None

    def __post_init__(self):
        self._last_lora_id = max((r.lora_int_id for r in self.settings.lora_modules.values()), default=0)
        if self.prompt_tokenizer is None:
            self.prompt_tokenizer = PromptTokenizer(self.tokenizer, self.max_model_len)
        if self.preparer is None:
            self.preparer = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dovetail-prepare")

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    def check_model(self, requested: Optional[str]) -> str:
        """The served name the response reports; 404 for a model this server does not serve."""
        if requested is None or requested == "":
            return self.model_name
        if requested not in self.settings.served_model_names and requested not in self.settings.lora_modules:
            names = ", ".join(repr(n) for n in [*self.settings.served_model_names, *self.settings.lora_modules])
            raise APIError(404, f"model: {requested!r} does not exist; this server serves {names}",
                           param="model", code="model_not_found")
        return requested

    def next_lora_id(self) -> int:
        """An adapter id no adapter of this server had (the engine keeps an id's folder for its life)."""
        self._last_lora_id += 1
        return self._last_lora_id

    def lora_for(self, model: str) -> Optional[LoRARequest]:
        """The adapter a request for the served name ``model`` runs with (None: the base model)."""
        return self.settings.lora_modules.get(model)

    def require_tokenizer(self, field_name: str) -> Any:
        if self.tokenizer is None:
            raise RequestError(f"{field_name}: this model has no tokenizer; send token ids", field=field_name)
        return self.tokenizer

    def tokenize(self, text: str, add_special_tokens: bool, field_name: str = "prompt",
                 allow_empty: bool = False, bounded: bool = True) -> list[int]:
        """The text's token ids; 400 naming the field for an empty text (unless allowed), one whose length
        alone exceeds the context (refused before tokenising, unless not ``bounded``: the request truncates
        it), or one the tokenizer fails on."""
        return self.prompt_tokenizer.encode(text, add_special_tokens, field_name, allow_empty=allow_empty,
                                            bounded=bounded)

    async def off_loop(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` in the preparing threads: the event loop keeps answering meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.preparer, fn)

    def check_sequences(self, n: int, num_prompts: int) -> None:
        """400 for a request of more than ``max_sequences_per_request`` sequences, before any work on it."""
        limit = self.settings.max_sequences_per_request
        if n * num_prompts > limit:
            prompts = f" for each of {num_prompts} prompts" if num_prompts > 1 else ""
            raise RequestError(f"n: {n} samples{prompts} make {n * num_prompts} sequences, more than this server "
                               f"takes in one request ({limit}, --max-sequences-per-request)", field="n")

    def check_token_ids(self, ids: list[int], field_name: str) -> None:
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise RequestError(f"{field_name}: token id {t} is out of the vocabulary [0, {self.vocab_size})",
                                   field=field_name)

    def check_prompt(self, ids: list[int], field_name: str = "prompt") -> None:
        """400 for an empty prompt, bad token ids, or a prompt that leaves no room to generate."""
        if not ids:
            raise RequestError(f"{field_name}: the prompt is empty", field=field_name)
        if len(ids) >= self.max_model_len:  # before looking at millions of ids
            raise RequestError(f"{field_name}: the prompt has {len(ids)} tokens, but max_model_len is "
                               f"{self.max_model_len} (at least one token must be generated)", field=field_name)
        self.check_token_ids(ids, field_name)

    def max_tokens(self, prompt_len: int, requested: Optional[int], default: Optional[int],
                   field_name: str = "max_tokens") -> int:
        """The requested ``max_tokens`` if it fits the context (else 400); the default is clamped to fit."""
        room = self.max_model_len - prompt_len
        if requested is not None:
            if requested > room:
                raise RequestError(
                    f"{field_name}: the prompt ({prompt_len} tokens) plus {field_name} ({requested}) exceeds "
                    f"the context of {self.max_model_len} tokens (max_model_len)", field=field_name)
            return requested
        return room if default is None else min(default, room)

    def render_chat(self, conversation: list[dict], add_generation_prompt: bool, tools: Optional[list[dict]] = None,
                    template_kwargs: Optional[dict] = None) -> tuple[str, list[int]]:
        """Apply the chat template (with ``tools`` and the request's ``chat_template_kwargs``); return the
        prompt text and its token ids."""
        tokenizer = self.require_tokenizer("messages")
        check_message_text(conversation)
        template = self.settings.chat_template
        if template is None and getattr(tokenizer, "chat_template", None) is None:
            raise RequestError("messages: this model's tokenizer has no chat template; start the server with "
                               "--chat-template, or use /v1/completions", field="messages")
        kwargs = dict(template_kwargs or {})
        reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise RequestError(f"chat_template_kwargs: {', '.join(reserved)} cannot be set here",
                               field="chat_template_kwargs")
        try:
            text = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False, chat_template=template,
                                                 add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as exc:  # jinja raises its own errors for conversations the template rejects
            raise RequestError(f"messages: the chat template rejected the conversation: {exc}",
                               field="messages") from None
        if not isinstance(text, str):
            raise RequestError("messages: the chat template did not render to text", field="messages")
        return text, self.tokenize(text, add_special_tokens=False, field_name="messages", allow_empty=True)

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"


def check_message_text(conversation: list[dict]) -> None:
    """400 naming ``messages.i.content`` for text no tokenizer can take (a lone surrogate is not Unicode text)."""
    for i, message in enumerate(conversation):
        content = message.get("content")
        if isinstance(content, str):
            try:
                content.encode("utf-8")
            except UnicodeEncodeError as bad:
                field = f"messages.{i}.content"
                raise RequestError(f"{field}: the text is not valid Unicode: a lone surrogate "
                                   f"{content[bad.start]!r} at character {bad.start}", field=field) from None
