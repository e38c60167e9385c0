"""``POST /v1/embeddings`` over a real socket, with the official ``openai`` client and raw HTTP: the vectors
equal HF transformers' on the same weights; bad inputs are 400s naming the field."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from test_pooling import save_base_model
from test_server_cli import API_KEY, ServerProcess, auth

TEXTS = ["hello world, the quick brown fox", "1 + 2 = 3; 7 * 6 = 42"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_base_model(tmp_path_factory.mktemp("embedding-server"), seed=2, matryoshka_dimensions=[16, 32])


@pytest.fixture(scope="module")
def server(model_dir):
    process = ServerProcess(model_dir, "--api-key", API_KEY, "--served-model-name", "tiny-embed",
                            "--max-model-len", "64", "--pooler-config", '{"pooling_type": "MEAN"}')
    yield process
    process.stop()


def hf_embedding(model_dir, ids: list[int], dimensions: int | None = None) -> np.ndarray:
    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        mean = model(torch.tensor([ids])).last_hidden_state[0].mean(0)
    return torch.nn.functional.normalize(mean[:dimensions], dim=0).numpy()


def test_the_openai_client_gets_hf_vectors(client, model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    reply = client.embeddings.create(model="tiny-embed", input=TEXTS)  # the client asks for base64
    assert reply.model == "tiny-embed" and [d.index for d in reply.data] == [0, 1]
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(map(len, ids))
    for data, token_ids in zip(reply.data, ids):
        np.testing.assert_allclose(data.embedding, hf_embedding(model_dir, token_ids), atol=2e-5, rtol=1e-4)
    cut = client.embeddings.create(model="tiny-embed", input=TEXTS[0], dimensions=16)
    np.testing.assert_allclose(cut.data[0].embedding, hf_embedding(model_dir, ids[0], 16), atol=2e-5, rtol=1e-4)


def test_token_ids_as_floats_or_base64(server, model_dir):
    body = {"model": "tiny-embed", "input": [[5, 6, 7, 8], [9, 10]]}
    floats = httpx.post(server.url("/v1/embeddings"), headers=auth(), json=body).json()
    packed = httpx.post(server.url("/v1/embeddings"), headers=auth(),
                        json={**body, "encoding_format": "base64"}).json()
    assert floats["object"] == "list" and floats["usage"] == {"prompt_tokens": 6, "total_tokens": 6}
    for plain, encoded, ids in zip(floats["data"], packed["data"], body["input"]):
        assert plain["object"] == "embedding" and len(plain["embedding"]) == 64
        decoded = np.frombuffer(base64.b64decode(encoded["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.asarray(plain["embedding"], dtype=np.float32))
        np.testing.assert_allclose(plain["embedding"], hf_embedding(model_dir, ids), atol=2e-5, rtol=1e-4)


def test_a_long_text_is_truncated_when_asked(server, model_dir):
    text = "the quick brown fox jumps over the lazy dog. " * 40
    refused = httpx.post(server.url("/v1/embeddings"), headers=auth(), json={"model": "tiny-embed", "input": text})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input"
    reply = httpx.post(server.url("/v1/embeddings"), headers=auth(),
                       json={"model": "tiny-embed", "input": text, "truncate_prompt_tokens": 8})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == 8
    last = AutoTokenizer.from_pretrained(str(model_dir))(text)["input_ids"][-8:]
    same = httpx.post(server.url("/v1/embeddings"), headers=auth(), json={"model": "tiny-embed", "input": last})
    np.testing.assert_allclose(reply.json()["data"][0]["embedding"], same.json()["data"][0]["embedding"],
                               atol=1e-6)


@pytest.mark.parametrize("body, param, text", [
    ({"input": []}, "input", "the input is empty"),
    ({"input": [[5, 6], [7, 400]]}, "input.1", "token id 400 is out of the vocabulary"),
    ({"input": list(range(1, 66))}, "input", "the input has 65 tokens, but max_model_len is 64"),
    ({"input": "hi", "dimensions": 20}, "dimensions", "20 is not among the model's sizes (16, 32)"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
    ({"input": [{"text": "hi"}]}, "input", "must be a string, a list of strings"),
])
def test_bad_inputs_are_400s_naming_the_field(server, body, param, text):
    reply = httpx.post(server.url("/v1/embeddings"), headers=auth(), json={"model": "tiny-embed", **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and text in error["message"], error


def test_generation_on_an_embedding_model_is_a_400(server):
    reply = httpx.post(server.url("/v1/completions"), headers=auth(),
                       json={"model": "tiny-embed", "prompt": "hello", "max_tokens": 2})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "model" and "pooling model" in error["message"]
    assert httpx.get(server.url("/health")).status_code == 200
    assert httpx.post(server.url("/v1/embeddings"), headers=auth(),
                      json={"model": "tiny-embed", "input": "hi"}).status_code == 200
