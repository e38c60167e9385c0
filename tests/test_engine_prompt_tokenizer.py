"""Prompt text to token ids: the character bound is sound, long prompts are refused untokenised, failures named."""

from __future__ import annotations

import random

import pytest

from dovetail.engine.prompt_tokenizer import PromptTokenizer, max_chars_per_token
from dovetail.errors import RequestError


@pytest.fixture(scope="module")
def bundled_tokenizer():
    from dovetail import model_loader
    from dovetail.llm import default_model

    return model_loader.load_tokenizer(model_loader.resolve_model_path(default_model()))


@pytest.fixture(scope="module")
def byte_level_tokenizer(tmp_path_factory):
    import tiny_models

    return tiny_models.build_tokenizer(tmp_path_factory.mktemp("byte-level-bpe"))


def _random_texts(alphabet: str, count: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 200))) for _ in range(count)]


@pytest.mark.parametrize("which", ["bundled_tokenizer", "byte_level_tokenizer"])
def test_no_token_covers_more_characters_than_the_bound(which, request):
    tokenizer = request.getfixturevalue(which)
    bound = max_chars_per_token(tokenizer)
    assert bound is not None and bound >= 1
    # Digits and signs the bundled model knows, words the BPE merged, special tokens, and text outside the vocabulary.
    alphabet = "0123456789+-= helloworldthequick<s></s><unk>é你😀\n"
    for text in _random_texts(alphabet) + ["hello world" * 20, "<s>" * 30, "9" * 150]:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert len(ids) * bound >= len(text), (text, len(ids), bound)


def _fast(model, normalizer=None, pre_tokenizer=None, added=()):
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(model)
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    for content, kwargs in added:
        tok.add_special_tokens([AddedToken(content, **kwargs)])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_no_bound_where_the_pipeline_can_swallow_text():
    from tokenizers import models, normalizers, pre_tokenizers

    vocab = {"<unk>": 0, "a": 1, "b": 2, "ab": 3}
    bpe = lambda **kw: models.BPE(vocab=vocab, merges=[("a", "b")], unk_token="<unk>", **kw)  # noqa: E731
    assert max_chars_per_token(_fast(bpe())) == 5  # "<unk>" is the longest string, and stands for one character
    assert max_chars_per_token(_fast(bpe(), pre_tokenizer=pre_tokenizers.ByteLevel())) == 5
    swallowing = {
        "fused unknowns": _fast(bpe(fuse_unk=True)),
        "whitespace removed": _fast(bpe(), pre_tokenizer=pre_tokenizers.Whitespace()),
        "control characters removed": _fast(bpe(), normalizer=normalizers.BertNormalizer()),
        "composition": _fast(bpe(), normalizer=normalizers.NFC()),
        "a word per token": _fast(models.WordLevel(vocab=vocab, unk_token="<unk>")),
        "added token eating spaces": _fast(bpe(), added=[("<mask>", {"rstrip": True})]),
    }
    for what, tokenizer in swallowing.items():
        assert max_chars_per_token(tokenizer) is None, what
    assert PromptTokenizer(swallowing["fused unknowns"], 16).max_chars is None


class _Spy:
    """A tokenizer that records the texts it is called on."""

    def __init__(self, inner):
        self.inner, self.texts = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, text, **kwargs):
        self.texts.append(text)
        return self.inner(text, **kwargs)


def test_a_text_too_long_by_its_characters_is_refused_without_tokenising(bundled_tokenizer):
    spy = _Spy(bundled_tokenizer)
    prompts = PromptTokenizer(spy, max_model_len=256)
    assert prompts.max_chars == 255 * prompts.max_chars_per_token
    with pytest.raises(RequestError, match=r"prompt\.2: the prompt has 4000 characters, so at least 800 tokens") as info:
        prompts.encode("1+1=" * 1000, field="prompt.2")
    assert info.value.field == "prompt.2"
    assert spy.texts == []
    fits = "1+1=" * 63  # 252 characters and 253 tokens with <s>: just fits
    assert len(prompts.encode(fits)) == 253 and spy.texts == [fits]
    with pytest.raises(RequestError, match="empty"):
        prompts.encode("")
    assert prompts.encode("", allow_empty=True) == bundled_tokenizer("").input_ids


def test_any_tokenizer_failure_is_the_requests_error_naming_the_field(bundled_tokenizer):
    class Failing:
        backend_tokenizer = None

        def __call__(self, text, **kwargs):
            raise RuntimeError("boom")

    with pytest.raises(RequestError, match=r"messages: the tokenizer cannot encode this text \(RuntimeError: boom\)"):
        PromptTokenizer(Failing(), 64).encode("hi", field="messages")
    with pytest.raises(RequestError, match="prompt: the text is not valid Unicode: a lone surrogate '\\\\ud800'"):
        PromptTokenizer(bundled_tokenizer, 256).encode("12+3\ud800=")


def test_texts_encoded_together_equal_one_by_one_and_a_culprit_is_named(byte_level_tokenizer):
    prompts = PromptTokenizer(byte_level_tokenizer, 512)
    texts = ["hello world", "<s> hi </s>", "café 你好 😀", "x" * 300, "  spaced  "]
    fields = [f"prompt.{i}" for i in range(len(texts))]
    assert prompts.encode_many(texts, fields) == [byte_level_tokenizer(t).input_ids for t in texts]
    assert prompts.encode_many(texts, fields, add_special_tokens=False) == \
        [byte_level_tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    with pytest.raises(RequestError, match=r"prompt\.1: the text is not valid Unicode"):
        prompts.encode_many(["fine", "12+3\ud800="], ["prompt.0", "prompt.1"])


def test_offline_generate_refuses_long_and_empty_prompts_and_tokenises_lists_alike(monkeypatch):
    from dovetail import LLM, SamplingParams

    llm = LLM(max_num_seqs=8)
    tokenizer = llm.get_tokenizer()
    calls = []
    call = type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__", lambda self, text, **kw: calls.append(text) or call(self, text, **kw))
    with pytest.raises(RequestError, match="characters"):
        llm.generate("1+1=" * 1000, use_tqdm=False)
    assert calls == []
    with pytest.raises(RequestError, match="prompt: the prompt is empty"):
        llm.generate(["12+34=", ""], use_tqdm=False)
    assert llm.llm_engine.num_unfinished_requests() == 0
    prompts = ["12+34=", "507-199=", "99+1="]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [call(tokenizer, p).input_ids for p in prompts]
    assert [o.outputs[0].text for o in outputs] == ["46", "308", "100"]
