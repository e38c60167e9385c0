"""A cross-encoder served over a real socket: ``/score``, ``/rerank`` and ``/classify`` give HF transformers'
scores on the same weights; bad requests are 400s naming the field."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from test_pooling_classifiers import DOCUMENTS, QUERY, cross_encoder_dir, hf_logits
from test_server_cli import API_KEY, ServerProcess, auth


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return cross_encoder_dir(tmp_path_factory.mktemp("served-reranker"), seed=3)


@pytest.fixture(scope="module")
def server(model_dir):
    process = ServerProcess(model_dir, "--api-key", API_KEY, "--served-model-name", "tiny-rerank",
                            "--max-model-len", "64")
    yield process
    process.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), headers=auth(), json={"model": "tiny-rerank", **body})


def hf_score(model_dir, first: str, second: str | None = None) -> float:
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tokenizer(first, text_pair=second)["input_ids"]
    return float(torch.sigmoid(hf_logits(model_dir, ids)[0]))


def test_score_rerank_and_classify_give_hf_scores(server, model_dir):
    expected = [hf_score(model_dir, QUERY, d) for d in DOCUMENTS]
    scored = post(server, "/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["index"] for d in scored["data"]] == [0, 1, 2] and scored["data"][0]["object"] == "score"
    assert [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=2e-5)
    assert scored["usage"]["prompt_tokens"] == scored["usage"]["total_tokens"] > 0

    documents = DOCUMENTS[::-1]  # the weights rank them in this order, so reranking must reorder
    reranked = post(server, "/v1/rerank", {"query": QUERY, "documents": documents, "top_n": 2}).json()
    order = sorted(range(3), key=lambda i: -expected[2 - i])[:2]
    assert order != [0, 1], "the test needs documents out of order"
    assert [r["index"] for r in reranked["results"]] == order
    assert [r["document"]["text"] for r in reranked["results"]] == [documents[i] for i in order]
    assert [r["relevance_score"] for r in reranked["results"]] == pytest.approx([expected[2 - i] for i in order],
                                                                                 abs=2e-5)
    assert reranked["usage"]["total_tokens"] == scored["usage"]["total_tokens"]

    classified = post(server, "/classify", {"input": [QUERY, DOCUMENTS[0]]}).json()
    assert [d["num_classes"] for d in classified["data"]] == [1, 1]
    assert classified["data"][0]["label"] == "LABEL_0"
    assert [d["probs"][0] for d in classified["data"]] == pytest.approx(
        [hf_score(model_dir, QUERY), hf_score(model_dir, DOCUMENTS[0])], abs=2e-5)


@pytest.mark.parametrize("path, body, param, text", [
    ("/score", {"text_1": [QUERY, QUERY], "text_2": DOCUMENTS}, "text_2", "3 texts for 2 in text_1"),
    ("/score", {"text_1": QUERY, "text_2": []}, "text_2", "no texts"),
    ("/rerank", {"query": QUERY, "documents": []}, "documents", "at least 1 item"),
    ("/rerank", {"query": QUERY, "documents": ["fine", ""]}, "documents.1", "the text is empty"),
    ("/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": -1}, "top_n", "greater than or equal to 0"),
    ("/rerank", {"query": "", "documents": DOCUMENTS}, "query", "the text is empty"),
    ("/rerank", {"query": QUERY, "documents": ["d"] * 257}, "documents", "257 inputs, more than this server takes"),
    ("/v1/embeddings", {"input": QUERY}, "task", "it can classify and score, not embed"),
    ("/v1/completions", {"prompt": QUERY, "max_tokens": 2}, "model", "runs as a pooling model"),
])
def test_bad_requests_are_400s_naming_the_field(server, path, body, param, text):
    reply = post(server, path, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and text in error["message"], error
