"""Logprobs in OpenAI's two formats: completions (parallel lists) and chat (a list of token objects)."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from dovetail.outputs import PositionLogprobs
from dovetail.server.streaming import finite

Decode = Callable[[int], str]


def _token_text(token_id: int, position: Optional[PositionLogprobs], decode: Decode) -> str:
    entry = position.get(token_id) if position else None
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return decode(token_id)


def completion_logprobs(token_ids: Sequence[int], positions: Sequence[Optional[PositionLogprobs]],
                        decode: Decode, text_offset: int = 0) -> dict:
    """``{tokens, token_logprobs, top_logprobs, text_offset}``; the sampled token is always in ``top_logprobs``.

    A position without logprobs (the first prompt token, under ``echo``) has ``null`` entries.
    """
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, position in zip(token_ids, positions):
        text = _token_text(token_id, position, decode)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if position is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(finite(position[token_id].logprob))
        ranked = sorted(position.items(), key=lambda kv: kv[1].rank or 0)
        top: dict[str, float] = {}
        for t, e in ranked:  # distinct tokens can decode to the same text; the likelier one is kept
            top.setdefault(_token_text(t, position, decode), finite(e.logprob))
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def _chat_token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs], top_n: int,
                  decode: Decode) -> dict:
    """``{"content": [{token, logprob, bytes, top_logprobs: [the top_n most likely tokens]}]}``."""
    content = []
    for token_id, position in zip(token_ids, positions):
        entry = _chat_token(_token_text(token_id, position, decode), position[token_id].logprob)
        top = sorted(((t, e) for t, e in position.items() if e.rank is not None and e.rank <= top_n),
                     key=lambda kv: kv[1].rank)
        entry["top_logprobs"] = [_chat_token(_token_text(t, position, decode), e.logprob) for t, e in top]
        content.append(entry)
    return {"content": content}
