"""Sequence classifiers (``*ForSequenceClassification``) as pooling models: ``LLM.classify`` and ``LLM.score``
against HF transformers' logits on the same weights, and the requests a classifier refuses."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForSequenceClassification, LlamaForSequenceClassification, \
    Qwen3Config, Qwen3ForSequenceClassification

import tiny_models
from dovetail import LLM, PoolingParams
from dovetail.errors import ConfigError, RequestError
from test_pooling import COMMON, PROMPTS, save_base_model

QUERY = "hello world, the quick brown fox"
DOCUMENTS = ["the lazy dog", "1 + 2 = 3; 7 * 6 = 42", "The engine schedules requests"]


def save_classifier(path, cls, config, seed: int = 0):
    torch.manual_seed(seed)
    cls(config).save_pretrained(str(path))
    tiny_models.build_tokenizer(path, vocab_size=300)
    return path


def qwen3_config(**overrides):
    values = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.1)
    return Qwen3Config(**{**values, **overrides})


@pytest.fixture(scope="module")
def three_labels(tmp_path_factory):
    config = qwen3_config(num_labels=3, id2label={0: "negative", 1: "neutral", 2: "positive"},
                          label2id={"negative": 0, "neutral": 1, "positive": 2})
    return save_classifier(tmp_path_factory.mktemp("qwen3-cls"), Qwen3ForSequenceClassification, config)


def cross_encoder_dir(path, seed: int = 1):
    """A one-label Llama sequence classifier: a cross-encoder (reranker) whose score is the sigmoid of its logit."""
    return save_classifier(path, LlamaForSequenceClassification, tiny_models.tiny_llama_config(num_labels=1), seed)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    return cross_encoder_dir(tmp_path_factory.mktemp("llama-reranker"))


def hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_classify_matches_hf_softmax_over_chunked_prompts(three_labels):
    llm = LLM(str(three_labels), max_num_batched_tokens=16, **COMMON)
    engine = llm.llm_engine
    assert engine.is_pooling and engine.pooling_model.task == "classify", "a sequence classifier pools by itself"
    assert engine.pooling_model.classifier.labels == ["negative", "neutral", "positive"]
    outputs = llm.classify([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs.num_classes == 3
        expected = torch.softmax(hf_logits(three_labels, prompt), dim=-1)
        torch.testing.assert_close(torch.tensor(output.outputs.probs), expected, atol=2e-5, rtol=1e-4)
    with pytest.raises(RequestError, match="task: scoring needs a classifier of one label") as caught:
        llm.score(QUERY, DOCUMENTS)
    assert caught.value.field == "task"


def test_score_is_the_sigmoid_of_the_pair_encodings_logit(cross_encoder):
    llm = LLM(str(cross_encoder), **COMMON)
    tokenizer = llm.get_tokenizer()
    one_to_many = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    pairwise = llm.score([QUERY, "1 + 2"], DOCUMENTS[:2], use_tqdm=False)
    for (first, second), output in zip([(QUERY, d) for d in DOCUMENTS] + [(QUERY, DOCUMENTS[0]),
                                                                          ("1 + 2", DOCUMENTS[1])],
                                       one_to_many + pairwise):
        ids = tokenizer(first, text_pair=second)["input_ids"]
        assert output.prompt_token_ids == ids
        expected = torch.sigmoid(hf_logits(cross_encoder, ids)[0])
        assert output.outputs.score == pytest.approx(float(expected), abs=2e-5)
    assert len({round(o.outputs.score, 6) for o in one_to_many}) == 3, "the documents score differently"
    classified = llm.classify(QUERY, use_tqdm=False)[0]
    expected = torch.sigmoid(hf_logits(cross_encoder, tokenizer(QUERY)["input_ids"]))
    torch.testing.assert_close(torch.tensor(classified.outputs.probs), expected, atol=2e-5, rtol=1e-4)


def test_requests_a_model_cannot_serve_are_named(cross_encoder, tmp_path):
    llm = LLM(str(cross_encoder), **COMMON)
    cases = [
        (lambda: llm.embed(QUERY), "task", "a sequence classifier: it can classify and score, not embed"),
        (lambda: llm.score([QUERY, QUERY], DOCUMENTS), "text_2", "3 texts for 2 in text_1"),
        (lambda: llm.score(QUERY, ["fine", ""]), "text_2.1", "the text is empty"),
        (lambda: llm.classify({"prompt_token_ids": list(range(65))}), "input", "the prompt has 65 tokens"),
    ]
    for call, field, text in cases:
        with pytest.raises(RequestError) as caught:
            call()
        assert caught.value.field == field and text in str(caught.value), str(caught.value)
    embedder = LLM(str(save_base_model(tmp_path / "embedder")), **COMMON)
    with pytest.raises(RequestError, match="task: this model is an embedding model: it can embed, not classify"):
        embedder.classify("hi")
    with pytest.raises(RequestError, match="dimensions: only embeddings have dimensions"):
        llm.llm_engine.add_request(None, "hi", PoolingParams(task="classify", dimensions=4))


def test_a_classifier_without_its_head_stops_the_start(tmp_path):
    path = save_base_model(tmp_path / "headless")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["Qwen3ForSequenceClassification"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"needs its head, score.weight \[num_labels, 64\], in the checkpoint "
                                          r"\(missing\)"):
        LLM(str(path), **COMMON)
