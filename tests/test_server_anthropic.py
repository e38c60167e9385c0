"""``/v1/messages`` (Anthropic's Messages API) through the ``anthropic`` client against ``dovetail serve`` of
the scripted agent model (:mod:`scripted_agent`): it thinks, then calls ``get_weather``.

Each message is checked against the chat completion of the same conversation: the same prompt tokens (so
``system``, content blocks, ``tool_use`` and ``tool_result`` become the messages a chat client would send)
and the same output, as ``thinking``, ``text`` and ``tool_use`` blocks.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from scripted_agent import ARGUMENTS, CALL, PARAMETERS, QUESTION, REASONING, agent_server
from test_server_cli import API_KEY, auth

TOOLS = [{"name": "get_weather", "description": "the forecast", "input_schema": PARAMETERS}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast",
                                                "parameters": PARAMETERS}}]
USER = [{"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    return agent_server(tmp_path_factory)


@pytest.fixture(scope="module")
def claude(server):
    """Anthropic's client, sending the key as ``x-api-key`` as Claude Code does."""
    with anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def _chat(client, messages, **kwargs):
    return client.chat.completions.create(model="scripted", messages=messages, max_tokens=20, **kwargs)


def _create(claude, messages=USER, **kwargs):
    return claude.messages.create(model="scripted", messages=messages, **{"max_tokens": 20, **kwargs})


def _blocks(message) -> dict:
    return {block.type: block for block in message.content}


def test_text_and_thinking_blocks_match_the_chat_completion(claude, client):
    chat = _chat(client, [{"role": "system", "content": "Be brief."}, *USER])
    message = _create(claude, system="Be brief.")
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["thinking", "text"]
    thinking, text = message.content
    assert thinking.thinking == REASONING == chat.choices[0].message.reasoning_content
    assert text.text == chat.choices[0].message.content == f"<tool_call>{CALL}</tool_call>"
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens


def test_stream_events_build_the_same_message(claude):
    whole = _create(claude)
    with claude.messages.stream(model="scripted", messages=USER, max_tokens=20) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == whole.usage.output_tokens
    starts = [e.index for e in events if e.type == "content_block_start"]
    stops = [e.index for e in events if e.type == "content_block_stop"]
    assert starts == stops == [0, 1]
    thinking = "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                       and e.delta.type == "thinking_delta")
    assert thinking == REASONING


def test_tool_use_blocks_and_tool_results_continue_the_conversation(claude, client):
    message = _create(claude, tools=TOOLS)
    assert message.stop_reason == "tool_use"
    call = _blocks(message)["tool_use"]
    assert call.name == "get_weather" and call.input == ARGUMENTS and call.id
    chat = _chat(client, USER, tools=CHAT_TOOLS)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat.usage.prompt_tokens

    with claude.messages.stream(model="scripted", messages=USER, max_tokens=20, tools=TOOLS) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta")
    assert json.loads(partial) == ARGUMENTS and _blocks(streamed)["tool_use"].input == ARGUMENTS
    assert streamed.stop_reason == "tool_use"

    follow_up = [*USER, {"role": "assistant", "content": [block.model_dump() for block in message.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees"},
                                              {"type": "text", "text": "And tomorrow?"}]}]
    answered = _create(claude, messages=follow_up, tools=TOOLS)
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"},
               {"role": "user", "content": "And tomorrow?"}]
    expected = _chat(client, history, tools=CHAT_TOOLS).usage.prompt_tokens
    assert answered.usage.input_tokens + answered.usage.cache_read_input_tokens == expected
    counted = claude.messages.count_tokens(model="scripted", messages=follow_up, tools=TOOLS)
    assert counted.input_tokens == expected


def test_tool_choice_none_and_stop_sequences(claude):
    plain = _create(claude, tools=TOOLS, tool_choice={"type": "none"})
    assert "tool_use" not in _blocks(plain) and plain.stop_reason == "end_turn"
    stopped = _create(claude, stop_sequences=["<tool_call>"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "<tool_call>"
    assert "text" not in _blocks(stopped) or _blocks(stopped)["text"].text == ""
    cut = _create(claude, max_tokens=2)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    roomy = _create(claude, max_tokens=100_000)  # a cap: the context left bounds it, as Claude Code expects
    assert roomy.stop_reason == "end_turn" and roomy.content[-1].text == f"<tool_call>{CALL}</tool_call>"


def test_output_config_format_constrains_the_text(claude):
    choices = ["sunny", "rainy"]
    message = _create(claude, output_config={"format": {"type": "json_schema", "schema": {"enum": choices}}})
    assert _blocks(message)["thinking"].thinking == REASONING  # the reasoning ran free
    assert json.loads(_blocks(message)["text"].text) in choices


def test_an_assistant_turn_at_the_end_is_continued(claude, server):
    body = {"model": "scripted", "max_tokens": 20,
            "messages": [*USER, {"role": "assistant", "content": "<think>"}]}
    counted = httpx.post(server.url("/v1/messages/count_tokens"), headers=auth(), json=body).json()["input_tokens"]
    answering = httpx.post(server.url("/v1/messages/count_tokens"), headers=auth(),
                           json={**body, "messages": USER}).json()["input_tokens"]
    assert counted == answering + 1  # the open "<think>" and no new assistant turn


def _post(server, path="/v1/messages", headers=None, **body) -> httpx.Response:
    return httpx.post(server.url(path), headers=headers if headers is not None else {"x-api-key": API_KEY},
                      timeout=60, json={"model": "scripted", "max_tokens": 20, **body})


@pytest.mark.parametrize("body, field", [
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages.0.content.0.tool_use_id"),
    ({"messages": USER, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"messages": USER, "tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"messages": USER, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"messages": USER, "tools": [{**TOOLS[0], "input_schema": {"type": "nonsense"}}],
      "tool_choice": {"type": "any"}}, "tools"),
    ({"messages": USER, "system": [{"type": "image"}]}, "system.0.type"),
    ({"messages": USER, "output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
     "output_config.format.schema"),
    ({"messages": USER, "model": "claude-unknown"}, "model"),
])
def test_bad_requests_are_anthropic_errors_naming_the_field(server, body, field):
    response = _post(server, **body)
    assert response.status_code in (400, 404), response.text
    payload = response.json()
    assert payload["type"] == "error" and payload["error"]["message"].startswith(field), payload
    assert payload["error"]["type"] == ("not_found_error" if response.status_code == 404 else "invalid_request_error")


def test_values_the_chat_request_cannot_take_are_400s_not_server_errors(server):
    from dovetail.errors import RequestError
    from dovetail.server.protocol import translated_chat_request

    with pytest.raises(RequestError, match="^messages: ") as caught:
        translated_chat_request({"messages": []})
    assert caught.value.field == "messages"
    assert _post(server, messages=USER, metadata={"user_id": 5}).status_code == 200  # not a user name: dropped


def test_the_key_is_taken_from_either_header_and_refused_in_anthropic_form(server):
    assert _post(server, messages=USER, headers=auth()).status_code == 200
    refused = _post(server, messages=USER, headers={"x-api-key": "wrong"})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url("/v1/models"), headers={"x-api-key": API_KEY}).status_code == 200
