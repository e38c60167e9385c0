"""Tool calling chosen by the model and reasoning, through the ``openai`` client against ``dovetail serve``
with ``--reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser hermes``.

The model is scripted (:func:`tiny_models.save_scripted_model`): after its generation prompt it thinks
``<think>...</think>`` and then calls ``get_weather`` in a ``<tool_call>`` block, so the parsers have a
known text to split; with ``enable_thinking=False`` its template closes the reasoning in the prompt and the
model goes straight to the call.
"""

from __future__ import annotations

import json

import httpx
import pytest

from scripted_agent import ARGUMENTS, CALL, REASONING, agent_server
from test_server_cli import auth

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    return agent_server(tmp_path_factory)


def _chat(client, **kwargs):
    return client.chat.completions.create(model="scripted", messages=MESSAGES, max_tokens=20, **kwargs)


def _stream(client, **kwargs) -> dict:
    state = {"reasoning": "", "content": "", "calls": {}, "finish_reason": None, "chunks": 0}
    for chunk in client.chat.completions.create(model="scripted", messages=MESSAGES, max_tokens=20, stream=True,
                                                **kwargs):
        state["chunks"] += 1
        choice = chunk.choices[0]
        delta = choice.delta
        state["reasoning"] += getattr(delta, "reasoning_content", None) or ""
        state["content"] += delta.content or ""
        for call in delta.tool_calls or []:
            entry = state["calls"].setdefault(call.index, {"id": None, "name": None, "arguments": ""})
            if call.id:
                assert entry["id"] is None
                entry["id"], entry["name"], entry["type"] = call.id, call.function.name, call.type
            entry["arguments"] += call.function.arguments or ""
        state["finish_reason"] = choice.finish_reason or state["finish_reason"]
    return state


def test_auto_tool_choice_parses_the_call_and_the_reasoning(client):
    response = _chat(client, tools=TOOLS)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == REASONING
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGUMENTS

    streamed = _stream(client, tools=TOOLS)
    assert streamed["finish_reason"] == "tool_calls"
    assert streamed["reasoning"] == REASONING and streamed["content"] == ""
    (call,) = streamed["calls"].values()
    assert call["type"] == "function" and call["name"] == "get_weather" and call["id"]
    assert json.loads(call["arguments"]) == ARGUMENTS


def test_prompt_tokens_details_count_the_prefix_cache_hits(client):
    first = _chat(client, tools=TOOLS)
    again = _chat(client, tools=TOOLS)  # the same prompt: its full blocks come from the prefix cache
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= again.usage.prompt_tokens == first.usage.prompt_tokens
    streamed = list(client.chat.completions.create(model="scripted", messages=MESSAGES, max_tokens=20, tools=TOOLS,
                                                   stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_chat_template_kwargs_reach_the_template(client):
    thinking = _chat(client, tools=TOOLS)
    response = _chat(client, tools=TOOLS, extra_body=NO_THINKING)
    assert response.usage.prompt_tokens == thinking.usage.prompt_tokens + 2  # "<think>" and "</think>"
    assert response.choices[0].message.reasoning_content is None
    assert response.choices[0].finish_reason == "tool_calls"
    assert json.loads(response.choices[0].message.tool_calls[0].function.arguments) == ARGUMENTS
    streamed = _stream(client, tools=TOOLS, extra_body=NO_THINKING)
    assert streamed["reasoning"] == "" and json.loads(streamed["calls"][0]["arguments"]) == ARGUMENTS


def test_without_tools_the_call_is_content_and_reasoning_still_splits(client):
    choice = _chat(client).choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.reasoning_content == REASONING
    assert choice.message.content == f"<tool_call>{CALL}</tool_call>"
    none = _chat(client, tools=TOOLS, tool_choice="none").choices[0]
    assert none.message.content == choice.message.content and none.message.tool_calls is None
    assert _chat(client, extra_body={"include_reasoning": False}).choices[0].message.reasoning_content is None
    streamed = _stream(client)
    assert streamed["reasoning"] == REASONING and streamed["content"] == choice.message.content
    assert streamed["calls"] == {} and streamed["finish_reason"] == "stop"


def test_structured_outputs_apply_after_the_reasoning(client):
    choices = ["sunny", "rainy"]
    response = _chat(client, extra_body={"structured_outputs": {"choice": choices}})
    message = response.choices[0].message
    assert message.reasoning_content == REASONING  # the reasoning ran free
    assert message.content in choices and response.choices[0].finish_reason == "stop"
    streamed = _stream(client, extra_body={"guided_choice": choices})
    assert streamed["reasoning"] == REASONING and streamed["content"] in choices
    no_thinking = _chat(client, extra_body={"guided_choice": choices, **NO_THINKING}).choices[0].message
    assert no_thinking.reasoning_content is None and no_thinking.content in choices


def _rendered(server, **body) -> str:
    response = httpx.post(server.url("/tokenize"), headers=auth(), timeout=60,
                          json={"model": "scripted", "messages": MESSAGES, **body})
    assert response.status_code == 200, response.text
    ids = response.json()["tokens"]
    detok = httpx.post(server.url("/detokenize"), headers=auth(), json={"model": "scripted", "tokens": ids})
    return detok.json()["prompt"]


def test_tools_and_tool_messages_go_through_the_template(server, client):
    plain = _rendered(server)
    with_tools = _rendered(server, tools=TOOLS)
    assert "<tools>" not in plain and "<tools>" in with_tools and '"name": "get_weather"' in with_tools
    assert _rendered(server, chat_template_kwargs={"enable_thinking": False}).endswith("<think></think>")

    first = _chat(client, tools=TOOLS).choices[0].message
    call = first.tool_calls[0]
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"}]
    rendered = _rendered(server, messages=history)
    assert f'<tool_call>{{"name": "get_weather", "arguments": {json.dumps(ARGUMENTS)}}}</tool_call>' in rendered
    assert "<tool_response>18 degrees</tool_response>" in rendered
    follow_up = client.chat.completions.create(model="scripted", messages=history, tools=TOOLS, max_tokens=20)
    assert follow_up.choices[0].finish_reason == "tool_calls"
