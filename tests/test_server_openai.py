"""The server through the official ``openai`` client: completions and chat, streaming and not."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from test_server_cli import API_KEY, MAIN_FLAGS, auth, shared_server

GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    return shared_server(tiny_llama_dir, *MAIN_FLAGS)


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    from dovetail import LLM

    return LLM(str(tiny_llama_dir), max_model_len=512)


def _streamed_completion(client, **kwargs):
    texts, finish, usage = {}, {}, None
    for chunk in client.completions.create(model="tiny", stream=True, stream_options={"include_usage": True},
                                           **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return texts, finish, usage


def test_completion_matches_the_offline_engine_and_its_stream(client, offline):
    from dovetail import SamplingParams

    reference = offline.generate("hello world", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                 use_tqdm=False)[0]
    response = client.completions.create(model="tiny", prompt="hello world", **GREEDY)
    assert response.object == "text_completion" and response.model == "tiny"
    assert response.choices[0].text == reference.outputs[0].text
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert response.usage.completion_tokens == 12
    texts, finish, usage = _streamed_completion(client, prompt="hello world", **GREEDY)
    assert texts == {0: reference.outputs[0].text}
    assert finish == {0: "length"}
    assert usage.completion_tokens == 12 and usage.total_tokens == usage.prompt_tokens + 12


def test_chat_matches_the_offline_engine_and_its_stream(client, offline):
    from dovetail import SamplingParams

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1 + 2 ="}]
    reference = offline.chat(messages, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                             use_tqdm=False)[0]
    response = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == reference.outputs[0].text
    assert response.usage.prompt_tokens == len(reference.prompt_token_ids)

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_max_completion_tokens_and_the_model_alias(client):
    response = client.chat.completions.create(model="tiny-alias", messages=[{"role": "user", "content": "hi"}],
                                              max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert response.model == "tiny-alias"
    assert response.usage.completion_tokens == 3
    # Without a limit, a chat reply may use the rest of the context.
    response = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              temperature=0, extra_body={"ignore_eos": True})
    assert response.choices[0].finish_reason == "length"
    assert response.usage.total_tokens == 512


def test_n2_gives_two_choices_streaming_or_not(client):
    response = client.completions.create(model="tiny", prompt="the quick", n=2, max_tokens=8, seed=7,
                                         extra_body={"ignore_eos": True})
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert response.usage.completion_tokens == 16
    texts, finish, _ = _streamed_completion(client, prompt="the quick", n=2, max_tokens=8, seed=7,
                                            extra_body={"ignore_eos": True})
    assert texts == {c.index: c.text for c in response.choices}
    assert finish == {0: "length", 1: "length"}
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=4, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model="tiny", prompt="The engine", max_tokens=16, temperature=1.0, top_p=0.95,
                  extra_body={"ignore_eos": True, "top_k": 50})
    first = client.completions.create(seed=1234, **kwargs).choices[0].text
    again = client.completions.create(seed=1234, **kwargs).choices[0].text
    other = client.completions.create(seed=4321, **kwargs).choices[0].text
    assert first == again
    assert first != other


def test_completion_logprobs(client):
    response = client.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=0, logprobs=3,
                                         extra_body={"ignore_eos": True})
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == response.choices[0].text or "\ufffd" in "".join(lp.tokens)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the sampled token is the likeliest
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_returns_the_prompt_and_its_logprobs(client):
    response = client.completions.create(model="tiny", prompt="hello world", max_tokens=2, temperature=0,
                                         echo=True, logprobs=1, extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert choice.text.startswith("hello world")
    prompt_len = response.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == prompt_len + 2
    assert choice.logprobs.token_logprobs[0] is None
    assert all(v <= 0 for v in choice.logprobs.token_logprobs[1:])


def test_chat_logprobs_streaming_and_not(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0,
                  logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    response = client.chat.completions.create(**kwargs)
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    for token in content:
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
        assert len(token.top_logprobs) == 2
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob, abs=1e-5)
        assert token.bytes == list(token.token.encode())
    streamed = [t for c in client.chat.completions.create(stream=True, **kwargs)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in content]


def _stop_string(text: str) -> str:
    for start in range(2, len(text) - 1):
        candidate = text[start:start + 2]
        if "\ufffd" not in candidate and candidate.strip():
            return candidate
    pytest.skip(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("prompt", ["hello world", "def f(x):"])
def test_stop_strings_cut_the_text_streaming_or_not(client, prompt):
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = _stop_string(full)
    expected = full[:full.find(stop)]
    stopped = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True}).choices[0]
    assert stopped.text == expected
    assert stopped.finish_reason == "stop"
    texts, finish, _ = _streamed_completion(client, prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                            extra_body={"ignore_eos": True})
    assert texts == {0: expected} and finish == {0: "stop"}


def test_token_id_prompts_and_prompt_lists(server, client):
    ids = httpx.post(server.url("/tokenize"), headers=auth(), json={"prompt": "hello world"}).json()["tokens"]
    by_text = client.completions.create(model="tiny", prompt="hello world", **GREEDY)
    by_ids = client.completions.create(model="tiny", prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model="tiny", prompt=[ids, [5, 6, 7]], n=2, **GREEDY)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert batch.choices[0].text == by_text.choices[0].text == batch.choices[1].text
    assert batch.usage.prompt_tokens == len(ids) + 3
    texts = client.completions.create(model="tiny", prompt=["hello world", "café"], **GREEDY)
    assert texts.choices[0].text == by_text.choices[0].text and len(texts.choices) == 2


def test_models_version_tokenize_detokenize(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"
    tok = httpx.post(server.url("/tokenize"), headers=auth(), json={"prompt": "hello world", "return_token_strs": True})
    body = tok.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) and body["max_model_len"] == 512
    back = httpx.post(server.url("/detokenize"), headers=auth(), json={"tokens": body["tokens"]}).json()
    assert back["prompt"] == "hello world"
    chat = httpx.post(server.url("/tokenize"), headers=auth(),
                      json={"messages": [{"role": "user", "content": "hi"}]}).json()
    rendered = httpx.post(server.url("/tokenize"), headers=auth(),
                          json={"prompt": "<|user|>hi</s><|assistant|>", "add_special_tokens": False}).json()
    assert chat["tokens"] == rendered["tokens"]


def _metric(text: str, name: str) -> float:
    """The value of ``name`` (with its labels, e.g. ``x_total{outcome="finished"}``) in Prometheus text."""
    for line in text.splitlines():
        if not line.startswith("#") and line.rsplit(" ", 1)[0] == name:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not found")


def _metrics(server) -> str:
    return httpx.get(server.url("/metrics"), headers=auth()).text


def test_64_concurrent_streams_all_finish_correctly(server, client):
    prompts = [[(7 * i + j) % 300 + 3 for j in range(4 + i % 5)] for i in range(64)]
    before = _metrics(server)

    async def one(aclient, prompt):
        text, finish, usage = "", None, None
        stream = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text += choice.text
                finish = choice.finish_reason or finish
        return text, finish, usage

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0,
                                      timeout=300) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    results = asyncio.run(run_all())
    assert len(results) == 64
    for prompt, (text, finish, usage) in zip(prompts, results):
        assert finish == "length"
        assert usage.completion_tokens == 8 and usage.prompt_tokens == len(prompt)
    # Each stream's text is the greedy text of its prompt, as one request alone produces it.
    for i in (0, 21, 63):
        alone = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text
        assert results[i][0] == alone
    after = _metrics(server)
    key = 'dovetail_requests_total{outcome="finished"}'
    assert _metric(after, key) - _metric(before, key) >= 64
    assert _metric(after, "dovetail_kv_cache_usage_perc") == 0.0


def test_metrics_cover_tokens_latencies_and_cache(server, client):
    prompt = "The engine schedules requests, caches prefixes and samples tokens. " * 2
    client.completions.create(model="tiny", prompt=prompt, **GREEDY)
    client.completions.create(model="tiny", prompt=prompt, **GREEDY)  # its full blocks hit the prefix cache
    text = _metrics(server)
    for name in ("dovetail_prompt_tokens_total", "dovetail_generation_tokens_total",
                 "dovetail_time_to_first_token_seconds_count", "dovetail_inter_token_latency_seconds_count",
                 "dovetail_e2e_request_latency_seconds_count"):
        assert _metric(text, name) > 0, name
    for name in ("dovetail_num_requests_running", "dovetail_num_requests_waiting", "dovetail_kv_cache_usage_perc",
                 "dovetail_num_preemptions_total", "dovetail_spec_decode_num_draft_tokens_total",
                 "dovetail_spec_decode_num_accepted_tokens_total"):
        assert _metric(text, name) >= 0
    assert 0 < _metric(text, "dovetail_prefix_cache_hit_rate") <= 1


def test_usage_has_no_prompt_tokens_details_unless_asked(client):
    usage = client.completions.create(model="tiny", prompt="hello world", **GREEDY).usage
    assert usage.prompt_tokens_details is None and usage.prompt_tokens > 0


def test_reset_prefix_cache_endpoint_forgets_the_cached_prompts(server, client):
    prompt = "After a reset the engine computes every prompt in full again, cached or not. " * 2
    client.completions.create(model="tiny", prompt=prompt, **GREEDY)
    client.completions.create(model="tiny", prompt=prompt, **GREEDY)  # a hit: the hit rate is above zero
    reset = httpx.post(server.url("/reset_prefix_cache"), headers=auth())
    assert reset.status_code == 200 and reset.json() == {"reset": True}
    before = _metric(_metrics(server), "dovetail_prefix_cache_hit_rate")
    client.completions.create(model="tiny", prompt=prompt, **GREEDY)  # no hit: the rate falls
    assert 0 < _metric(_metrics(server), "dovetail_prefix_cache_hit_rate") < before
