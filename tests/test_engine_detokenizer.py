"""Incremental detokenization: never splits a multi-byte character, equals a full decode."""

from __future__ import annotations

import pytest

from dovetail.engine.detokenizer import IncrementalDetokenizer
from tiny_models import build_tokenizer

TEXTS = ["café naïve résumé", "你好，世界", "emoji 😀 and more 😀😀", "plain ascii text, with commas."]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode_and_has_no_broken_characters(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=tokenizer("hello", add_special_tokens=False).input_ids)
    deltas = [detok.step(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) + detok.flush() == tokenizer.decode(ids)


def test_a_partial_character_is_held_back_until_complete(tokenizer):
    ids = tokenizer("😀", add_special_tokens=False).input_ids
    assert len(ids) > 1, "the emoji must span several byte tokens for this test"
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[])
    deltas = [detok.step(i) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "😀"


def test_special_tokens_are_skipped_or_kept(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer("hello", add_special_tokens=False).input_ids
    skipping = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    keeping = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(skipping.step(i) for i in ids + [eos]) == "hello"
    assert "".join(keeping.step(i) for i in ids + [eos]) == "hello</s>"
