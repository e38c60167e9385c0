"""Reasoning parsers (vLLM's ``--reasoning-parser``): where a model's thinking ends and its answer begins.

Models such as Qwen3 and DeepSeek-R1 think between ``<think>`` and ``</think>``
before they answer. The server moves that text into ``reasoning_content``, and
the engine starts a request's structured-outputs grammar only once the thinking
is over (the answer is what must follow the schema).

Output is in its reasoning from its first token when it opens with ``<think>``,
or when the prompt left a ``<think>`` open (DeepSeek-R1's template ends with one);
DeepSeek-R1 always starts in its reasoning, as its models may omit the tag. A
reasoning that never closes is all reasoning. The same rule serves whole texts
and streams, so both split a text alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from dovetail.errors import ConfigError


@dataclass(frozen=True)
class ReasoningFormat:
    """The tags of one model family's reasoning."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    #: Output is reasoning from its start even without the opening tag.
    always_starts_in_reasoning: bool = False


FORMATS = {
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek_r1": ReasoningFormat("deepseek_r1", always_starts_in_reasoning=True),
}


def reasoning_parser_names() -> list[str]:
    return sorted(FORMATS)


class ReasoningParser:
    """One format bound to a tokenizer: its tags' token ids, and how text splits into reasoning and answer."""

    def __init__(self, name: str, tokenizer):
        if name not in FORMATS:
            known = ", ".join(reasoning_parser_names())
            raise ConfigError(f"reasoning_parser: unknown parser {name!r} (known: {known})")
        self.format = FORMATS[name]
        if tokenizer is None:
            raise ConfigError(f"reasoning_parser: {name} needs the model's tokenizer, and this model has none")
        vocab = tokenizer.get_vocab()
        missing = [tag for tag in (self.format.start, self.format.end) if tag not in vocab]
        if missing:
            raise ConfigError(f"reasoning_parser: {name} needs {' and '.join(map(repr, missing))} as single tokens "
                              "of the tokenizer, which has no such token")
        self.start_id = vocab[self.format.start]
        self.end_id = vocab[self.format.end]

    # -- token ids (the engine) ---------------------------------------------------------------------

    def _last_tag(self, token_ids: list[int]) -> int | None:
        for token in reversed(token_ids):
            if token == self.start_id or token == self.end_id:
                return token
        return None

    def prompt_opens_reasoning(self, prompt_token_ids: list[int]) -> bool:
        """Whether the prompt ends inside a reasoning (its last tag opens one)."""
        return self._last_tag(prompt_token_ids) == self.start_id

    def prompt_ends_reasoning(self, prompt_token_ids: list[int]) -> bool:
        """Whether the prompt already closed the reasoning (its last tag closes one, e.g. a template that
        turned thinking off): the answer starts at once."""
        return self._last_tag(prompt_token_ids) == self.end_id

    # -- text (the server) ----------------------------------------------------------------------------

    def starts_in_reasoning(self, prompt_opens: bool) -> bool:
        return self.format.always_starts_in_reasoning or prompt_opens

    def split(self, text: str, prompt_opens: bool = False) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole output; either is None when empty."""
        reasoning, content = _split(self.format, text, self.starts_in_reasoning(prompt_opens), final=True)
        return reasoning or None, content or None

    def stream(self, prompt_opens: bool = False) -> "ReasoningStream":
        return ReasoningStream(self.format, self.starts_in_reasoning(prompt_opens))


def _split(fmt: ReasoningFormat, text: str, in_reasoning: bool, final: bool) -> tuple[str, str]:
    """``(reasoning, content)`` of ``text`` so far; unless ``final``, a tail that may still grow into a tag
    is left out of both."""
    stripped = text.lstrip()
    if stripped.startswith(fmt.start):
        in_reasoning, text = True, stripped[len(fmt.start):]
    elif not final and fmt.start.startswith(stripped):
        return "", ""  # may still be the opening tag
    if not in_reasoning:
        return "", text
    reasoning, closed, content = text.partition(fmt.end)
    if closed:
        return reasoning, content
    if not final:
        reasoning = reasoning[:len(reasoning) - _partial_suffix(reasoning, fmt.end)]
    return reasoning, ""


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningStream:
    """Splits a growing output: each call takes the whole text so far and returns what is new on each side."""

    def __init__(self, fmt: ReasoningFormat, in_reasoning: bool):
        self.format, self.in_reasoning = fmt, in_reasoning
        self.sent_reasoning = 0
        self.sent_content = 0

    def update(self, text: str, final: bool = False) -> tuple[str, str]:
        """``(reasoning delta, content delta)`` for the output ``text`` so far."""
        reasoning, content = _split(self.format, text, self.in_reasoning, final)
        delta = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning = max(self.sent_reasoning, len(reasoning))
        self.sent_content = max(self.sent_content, len(content))
        return delta
