"""Prompt text to token ids, without letting one prompt cost everyone else.

A prompt whose length in characters alone proves that it cannot fit the context
is refused before it is tokenised: no token of the tokenizer covers more than
``max_chars_per_token`` characters of the text, so a text of more than
``(max_model_len - 1) * max_chars_per_token`` characters has at least
``max_model_len`` tokens. The bound is read once from the tokenizer's pipeline,
and only where that pipeline makes it sound (see :func:`max_chars_per_token`).
Any exception the tokenizer raises on a text is the request's fault: it becomes
a :class:`RequestError` naming the field.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional, Sequence

from dovetail.errors import RequestError

logger = logging.getLogger("dovetail")

# Normalizers that never merge or delete characters (decomposition, lowercasing and prefixes only lengthen).
_LENGTHENING_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend"}
# Pre-tokenizers that split the text without dropping any of it (ByteLevel turns each byte into a character).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}


def _normalizer_keeps_length(spec: Optional[dict]) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_normalizer_keeps_length(s) for s in spec.get("normalizers", []))
    if kind == "Replace":
        pattern = (spec.get("pattern") or {}).get("String")
        return isinstance(pattern, str) and 0 < len(pattern) <= len(spec.get("content") or "")
    return kind in _LENGTHENING_NORMALIZERS


def _pre_tokenizer_keeps_text(spec: Optional[dict]) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_text(s) for s in spec.get("pretokenizers", []))
    if kind == "Split":
        return spec.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _model_covers_bounded_text(spec: dict) -> bool:
    """Whether every token of the model stands for its own string (no unknown token swallowing a run)."""
    kind = spec.get("type")
    if kind == "BPE":
        return bool(spec.get("byte_fallback")) or not (spec.get("fuse_unk") and spec.get("unk_token") is not None)
    if kind == "Unigram":
        return bool(spec.get("byte_fallback"))
    return False  # WordLevel and WordPiece map a whole word of any length to one unknown token


def max_chars_per_token(tokenizer: Any) -> Optional[int]:
    """The most characters of input text one token can stand for, or None where no sound bound exists.

    Sound for a fast (``tokenizers``) tokenizer whose normalizer never shortens the text, whose
    pre-tokenizer drops none of it, whose model maps each token to its own vocabulary string (BPE,
    or Unigram with byte fallback) and whose added tokens swallow no whitespace: a token then covers
    at most as many characters as its string has (byte-level strings have one character per byte,
    and a character is at least one byte).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # a tokenizer the library cannot serialise: no bound, prompts are tokenised to be measured
        return None
    model = spec.get("model") or {}
    added = spec.get("added_tokens") or []
    if not (_normalizer_keeps_length(spec.get("normalizer")) and _pre_tokenizer_keeps_text(spec.get("pre_tokenizer"))
            and _model_covers_bounded_text(model)) or any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    vocab = model.get("vocab") or {}
    strings = list(vocab) if isinstance(vocab, dict) else [entry[0] for entry in vocab]
    strings += [t.get("content", "") for t in added]
    longest = max((len(s) for s in strings), default=0)
    return longest or None


class PromptTokenizer:
    """Tokenises prompts for one model: the character bound first, then the tokenizer, errors named by field."""

    def __init__(self, tokenizer: Any, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_chars_per_token = max_chars_per_token(tokenizer) if tokenizer is not None else None
        self.max_chars = (max_model_len - 1) * self.max_chars_per_token if self.max_chars_per_token else None

    def require(self, field: str) -> Any:
        if self.tokenizer is None:
            raise RequestError(f"{field}: this model has no tokenizer; send token ids", field=field)
        return self.tokenizer

    def check_length(self, text: str, field: str) -> None:
        """Refuse a text that has at least ``max_model_len`` tokens whatever they are, without tokenising it."""
        if self.max_chars is not None and len(text) > self.max_chars:
            at_least = -(-len(text) // self.max_chars_per_token)
            raise RequestError(
                f"{field}: the prompt has {len(text)} characters, so at least {at_least} tokens (a token of this "
                f"tokenizer covers at most {self.max_chars_per_token}), but max_model_len is {self.max_model_len} "
                "(at least one token must be generated)", field=field)

    def encode(self, text: str, add_special_tokens: bool = True, field: str = "prompt",
               allow_empty: bool = False, bounded: bool = True) -> list[int]:
        """The token ids of ``text``; :class:`RequestError` for an empty or (when ``bounded``: a request that
        will not truncate it) surely too long text, or one the tokenizer rejects."""
        tokenizer = self.require(field)
        if not text and not allow_empty:
            raise RequestError(f"{field}: the prompt is empty", field=field)
        if bounded:
            self.check_length(text, field)
        try:
            return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
        except Exception as exc:
            raise self._encoding_error(text, field, exc) from None

    def encode_many(self, texts: Sequence[str], fields: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """:meth:`encode` of each text; a fast tokenizer encodes them together, in its own threads."""
        tokenizer = self.require(fields[0] if fields else "prompt")
        for text, field in zip(texts, fields):
            if not text:
                raise RequestError(f"{field}: the prompt is empty", field=field)
            self.check_length(text, field)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or len(texts) < 2 or getattr(tokenizer, "split_special_tokens", False) \
                or getattr(backend, "encode_special_tokens", False):
            return [self.encode(t, add_special_tokens, f) for t, f in zip(texts, fields)]
        try:
            # What the tokenizer's own __call__ does for a batch, without building a BatchEncoding per text.
            return [e.ids for e in backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]
        except Exception:
            return [self.encode(t, add_special_tokens, f) for t, f in zip(texts, fields)]  # names the culprit

    def encode_pair(self, first: str, second: str, fields: tuple[str, str] = ("text_1", "text_2")) -> list[int]:
        """The tokenizer's encoding of a text pair (a cross-encoder's query and document, with its separators)."""
        tokenizer = self.require(fields[0])
        for text, field in zip((first, second), fields):
            if not isinstance(text, str) or not text:
                raise RequestError(f"{field}: the text is empty", field=field)
            self.check_length(text, field)
        try:
            return list(tokenizer(first, text_pair=second).input_ids)
        except Exception as exc:
            raise self._encoding_error(first + second, fields[0], exc) from None

    @staticmethod
    def _encoding_error(text: str, field: str, exc: Exception) -> RequestError:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as bad:
            return RequestError(f"{field}: the text is not valid Unicode: a lone surrogate "
                                f"{text[bad.start]!r} at character {bad.start}", field=field)
        return RequestError(f"{field}: the tokenizer cannot encode this text ({type(exc).__name__}: {exc})",
                            field=field)
