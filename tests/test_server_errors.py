"""Error statuses in OpenAI's format, client disconnects, and bad input that must not disturb other requests."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from test_server_cli import API_KEY, MAIN_FLAGS, auth, shared_server


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    return shared_server(tiny_llama_dir, *MAIN_FLAGS)


def _post(server, path, body, headers=None, **kwargs):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url(path), content=content, timeout=60,
                      headers={"Content-Type": "application/json", **auth(), **(headers or {})}, **kwargs)


def _assert_error(response, status, field=None, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if field is not None:
        assert error["param"] == field, error
        assert error["message"].startswith(field), error
    if code is not None:
        assert error["code"] == code
    return error


LONG_PROMPT = list(range(3, 300)) * 2  # 594 token ids: longer than max_model_len (512)

BAD_COMPLETIONS = [
    ({"prompt": [5, -1, 7]}, "prompt"),
    ({"prompt": [5, 320]}, "prompt"),  # the vocabulary has 320 entries
    ({"prompt": [[5, 6], [7, 99999]]}, "prompt.1"),
    ({"prompt": "hello", "max_tokens": 600}, "max_tokens"),
    ({"prompt": "hello", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hello", "temperature": -0.5}, "temperature"),
    ({"prompt": "hello", "top_p": 0}, "top_p"),
    ({"prompt": "hello", "n": 0}, "n"),
    ({"prompt": "hello", "logprobs": 21}, "logprobs"),
    ({"prompt": "hello", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "hello", "logit_bias": {"not-a-token": 1}}, "logit_bias"),
    ({"prompt": "hello", "logit_bias": {"100000": 1}}, "logit_bias"),
    ({"prompt": "hello", "logit_bias": {"5": 500}}, "logit_bias"),
    ({"prompt": "hello", "stop_token_ids": [-3]}, "stop_token_ids"),
    ({"prompt": "hello", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"prompt": "hello", "seed": 2**70}, "seed"),
    ({"prompt": "hello", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": LONG_PROMPT}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1.5, 2]}, "prompt"),
    ({"prompt": "hello", "stop": [""]}, "stop"),
    ({}, "prompt"),
]


@pytest.mark.parametrize("body,field", BAD_COMPLETIONS, ids=[f for _, f in BAD_COMPLETIONS])
def test_invalid_completion_values_are_400_naming_the_field(server, body, field):
    _assert_error(_post(server, "/v1/completions", body), 400, field)


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x" * 5000}]}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools.0.function"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "yaml"}}, "response_format.type"),
]


@pytest.mark.parametrize("body,field", BAD_CHATS, ids=[f for _, f in BAD_CHATS])
def test_invalid_chat_values_are_400_naming_the_field(server, body, field):
    _assert_error(_post(server, "/v1/chat/completions", body), 400, field)


@pytest.mark.parametrize("raw", [b'{"prompt": "hi"', b"not json", b'{"prompt": "hi", "temperature": NaN}', b"[1, 2]"])
def test_malformed_json_is_400(server, raw):
    error = _assert_error(_post(server, "/v1/completions", raw), 400)
    assert error["message"].startswith(("body", "temperature"))


@pytest.mark.parametrize("raw,expected", [
    (b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "nests arrays or objects too deeply"),
    (b'{"prompt": "hi", "max_tokens": ' + b"1" * 5000 + b"}", "a number in the JSON has too many digits"),
    (b'{"prompt": "\xff"}', "not valid UTF-8"),
], ids=["deeply-nested", "5000-digit-number", "not-utf8"])
def test_a_body_that_cannot_be_parsed_says_why(server, raw, expected):
    rejected = _metric(server, REJECTED)
    error = _assert_error(_post(server, "/v1/completions", raw), 400)
    assert error["message"].startswith("body: ") and expected in error["message"]
    if expected != "not valid UTF-8":
        assert "UTF-8" not in error["message"]
    assert _metric(server, REJECTED) == rejected + 1


#: Request text with a lone surrogate (valid JSON, but not Unicode text any tokenizer takes).
SURROGATE = "12+3\\ud800="
TOKENIZER_FAILURES = [
    ("/v1/completions", '{"prompt": "%s", "max_tokens": 2}' % SURROGATE, "prompt"),
    ("/v1/completions", '{"prompt": ["hi", "%s"], "max_tokens": 2}' % SURROGATE, "prompt.1"),
    ("/v1/chat/completions", '{"messages": [{"role": "system", "content": "hi"}, {"role": "user", "content": "%s"}]}'
     % SURROGATE, "messages.1.content"),
    ("/tokenize", '{"prompt": "%s"}' % SURROGATE, "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "%s"}]}' % SURROGATE, "messages.0.content"),
]


@pytest.mark.parametrize("path,raw,field", TOKENIZER_FAILURES, ids=[f"{p}-{f}" for p, _, f in TOKENIZER_FAILURES])
def test_text_the_tokenizer_cannot_take_is_the_clients_400(server, path, raw, field):
    rejected, errors = _metric(server, REJECTED), _metric(server, ERRORS)
    error = _assert_error(_post(server, path, raw), 400, field)
    assert "lone surrogate" in error["message"]
    if path != "/tokenize":
        assert _metric(server, REJECTED) == rejected + 1
    assert _metric(server, ERRORS) == errors


def test_head_health_and_hosts_with_a_key(server):
    assert httpx.head(server.url("/health")).status_code == 200
    # With an API key, the key is what a rebinding page lacks: any Host header is answered.
    response = httpx.get(server.url("/v1/models"), headers={**auth(), "Host": "attacker.example"})
    assert response.status_code == 200


def test_tokenize_and_detokenize_errors(server):
    _assert_error(_post(server, "/detokenize", {"tokens": [1, -5]}), 400, "tokens")
    _assert_error(_post(server, "/detokenize", {"tokens": [1, 10**6]}), 400, "tokens")
    _assert_error(_post(server, "/tokenize", {}), 400, "prompt")
    _assert_error(_post(server, "/tokenize", {"prompt": "a", "model": "gpt-4"}), 404, "model")


def test_unknown_model_or_path_is_404(server):
    _assert_error(_post(server, "/v1/completions", {"prompt": "hi", "model": "gpt-4"}), 404, "model",
                  "model_not_found")
    _assert_error(_post(server, "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}], "model": "nope"}), 404, "model")
    _assert_error(httpx.get(server.url("/v1/models/gpt-4"), headers=auth()), 404, "model")
    _assert_error(httpx.get(server.url("/v1/nothing-here"), headers=auth()), 404)
    with openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0) as client:
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-4", prompt="hi")


def test_wrong_api_key_through_the_openai_client(server):
    with openai.OpenAI(base_url=server.url("/v1"), api_key="sk-wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model="tiny", prompt="hi")


def test_oversized_body_is_413_with_or_without_content_length(server):
    big = json.dumps({"prompt": "x" * 250_000}).encode()
    _assert_error(_post(server, "/v1/completions", big), 413, code="request_too_large")

    def chunks():
        for i in range(0, len(big), 16_384):
            yield big[i:i + 16_384]

    response = httpx.post(server.url("/v1/completions"), content=chunks(), timeout=60,
                          headers={"Content-Type": "application/json", **auth()})
    _assert_error(response, 413, code="request_too_large")
    # A body under the limit sent without Content-Length still works.
    small = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    response = httpx.post(server.url("/v1/completions"), content=iter([small[:5], small[5:]]), timeout=60,
                          headers={"Content-Type": "application/json", **auth()})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


def _metric(server, name):
    for line in httpx.get(server.url("/metrics"), headers=auth()).text.splitlines():
        if line.rsplit(" ", 1)[0] == name:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(name)


def _wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


ABORTED = 'dovetail_requests_total{outcome="aborted"}'
REJECTED = 'dovetail_requests_total{outcome="rejected"}'
ERRORS = 'dovetail_requests_total{outcome="error"}'


def test_stream_disconnect_aborts_the_request_and_frees_its_blocks(server):
    aborted = _metric(server, ABORTED)
    generated = _metric(server, "dovetail_generation_tokens_total")
    body = {"prompt": "hi", "max_tokens": 500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url("/v1/completions"), json=body, headers=auth(), timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"] is not None
        assert _metric(server, "dovetail_kv_cache_usage_perc") > 0  # the request holds blocks while it runs
    # Leaving the block closed the connection mid-stream.
    assert _wait_for(lambda: _metric(server, ABORTED) == aborted + 1)
    assert _wait_for(lambda: _metric(server, "dovetail_kv_cache_usage_perc") == 0.0)
    assert _metric(server, "dovetail_num_requests_running") == 0
    assert _metric(server, "dovetail_generation_tokens_total") - generated < 500


def test_non_streaming_disconnect_aborts_too(server):
    aborted = _metric(server, ABORTED)
    body = {"prompt": "hi", "max_tokens": 500, "ignore_eos": True, "n": 4}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url("/v1/completions"), json=body, headers=auth(), timeout=httpx.Timeout(60, read=0.1))
    assert _wait_for(lambda: _metric(server, ABORTED) == aborted + 1)
    assert _wait_for(lambda: _metric(server, "dovetail_kv_cache_usage_perc") == 0.0)


def test_bad_requests_do_not_disturb_a_running_stream(server):
    body = {"prompt": "hello world", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    expected = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    streamed, statuses = [], []

    def flood():
        bad = [body | {"temperature": -1}, body | {"prompt": [-1]}, b"{oops", body | {"max_tokens": 10**6},
               body | {"prompt": LONG_PROMPT}, body | {"model": "x"}, body | {"logit_bias": {"1": 1e9}}]
        for _ in range(5):
            for b in bad:
                statuses.append(_post(server, "/v1/completions", b).status_code)

    with httpx.stream("POST", server.url("/v1/completions"), json=body | {"stream": True}, headers=auth(),
                      timeout=60) as response:
        flooder = threading.Thread(target=flood)
        flooder.start()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                streamed.append(json.loads(line[6:])["choices"][0]["text"])
        flooder.join()
    assert "".join(streamed) == expected
    assert set(statuses) <= {400, 404} and len(statuses) == 35
    assert httpx.get(server.url("/health")).status_code == 200
