"""Structured outputs and forced tool calls through the official ``openai`` client against ``dovetail serve``
(the tiny random Llama, sampled at temperature 1 with seeds: the constraint alone makes the output valid)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from test_server_cli import MAIN_FLAGS, auth, shared_server

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "count"]}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    return shared_server(tiny_llama_dir, *MAIN_FLAGS)


def _streamed_chat(client, **kwargs) -> dict[int, dict]:
    """Per choice: the content, the tool calls assembled from their deltas, and the finish reason."""
    choices: dict[int, dict] = {}
    for chunk in client.chat.completions.create(model="tiny", stream=True, **kwargs):
        for choice in chunk.choices:
            state = choices.setdefault(choice.index, {"content": "", "calls": {}, "finish_reason": None})
            state["content"] += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = state["calls"].setdefault(call.index, {"id": None, "name": None, "arguments": ""})
                if call.id:
                    assert entry["id"] is None, "a call's id comes once, in its first delta"
                    entry["id"], entry["name"] = call.id, call.function.name
                entry["arguments"] += call.function.arguments or ""
            if choice.finish_reason:
                state["finish_reason"] = choice.finish_reason
    return choices


def test_json_schema_outputs_that_stop_validate_streamed_and_not(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=0, n=6,
                                              max_tokens=200, response_format=response_format)
    texts = [c.message.content for c in response.choices if c.finish_reason == "stop"]
    streamed = _streamed_chat(client, messages=MESSAGES, temperature=1.0, seed=10, n=4, max_tokens=200,
                              response_format=response_format)
    streamed_texts = [s["content"] for s in streamed.values() if s["finish_reason"] == "stop"]
    assert texts and streamed_texts, (response.choices, streamed)
    for text in texts + streamed_texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_choice_regex_and_grammar_through_vllm_fields(client):
    sampled = dict(temperature=1.0, max_tokens=40)
    choices = ["red", "green", "deep blue"]
    for seed, extra in enumerate(({"guided_choice": choices}, {"structured_outputs": {"choice": choices}})):
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, seed=seed, n=3, extra_body=extra,
                                             **sampled)
        assert all(c.message.content in choices and c.finish_reason == "stop" for c in out.choices)
    pattern = r"[A-Z][a-z]{2,5} \d\d"
    out = client.completions.create(model="tiny", prompt="hello", seed=3, n=3, extra_body={"guided_regex": pattern},
                                    **sampled)
    assert all(re.fullmatch(pattern, c.text) and c.finish_reason == "stop" for c in out.choices)
    grammar = 'root ::= "(" [0-9] ("+" [0-9])? ")"'
    out = client.completions.create(model="tiny", prompt="1 + 2", seed=4, n=3, extra_body={"guided_grammar": grammar},
                                    **sampled)
    assert all(re.fullmatch(r"\(\d(\+\d)?\)", c.text) for c in out.choices)
    out = client.completions.create(model="tiny", prompt="hello", seed=5, max_tokens=200, temperature=1.0, n=4,
                                    extra_body={"response_format": {"type": "json_object"},
                                                "structured_outputs": None})
    assert all(c.text.lstrip().startswith(("{", "[")) for c in out.choices)
    for c in out.choices:
        if c.finish_reason == "stop":
            json.loads(c.text)
    stream = client.completions.create(model="tiny", prompt="hello", seed=6, stream=True,
                                       extra_body={"guided_json": SCHEMA, "guided_whitespace_pattern": ""},
                                       temperature=1.0, max_tokens=60)
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_named_tool_choice_returns_validated_arguments(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                              temperature=1.0, seed=1, n=4, max_tokens=200)
    called = [c for c in response.choices if c.finish_reason == "stop"]
    assert called, response.choices
    for c in called:
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    streamed = _streamed_chat(client, messages=MESSAGES, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=2,
                              n=3, max_tokens=200)
    done = [s for s in streamed.values() if s["finish_reason"] == "stop"]
    assert done, streamed
    for state in done:
        assert state["content"] == "" and list(state["calls"]) == [0]
        assert state["calls"][0]["name"] == "get_weather" and state["calls"][0]["id"]
        jsonschema.validate(json.loads(state["calls"][0]["arguments"]), WEATHER)


def test_required_tool_choice_calls_some_of_the_tools(client):
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                              temperature=1.0, seed=3, n=4, max_tokens=250,
                                              extra_body={"parallel_tool_calls": False})
    called = [c for c in response.choices if c.finish_reason == "tool_calls"]
    assert called, response.choices
    for c in called:
        (call,) = c.message.tool_calls  # parallel_tool_calls=false: one call
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    streamed = _streamed_chat(client, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0,
                              seed=5, n=4, max_tokens=250)
    complete = []  # a call is complete once its arguments are (the list may still be cut short after it)
    for state in streamed.values():
        for call in state["calls"].values():
            try:
                complete.append((call["name"], json.loads(call["arguments"])))
            except ValueError:
                assert state["finish_reason"] == "length"
    assert complete, streamed
    for name, arguments in complete:
        jsonschema.validate(arguments, PARAMETERS[name])


def _post(server, path, body):
    return httpx.post(server.url(path), json=body, headers=auth(), timeout=60)


def _assert_400(response, field):
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(field), error
    return error


CHAT = {"messages": MESSAGES, "max_tokens": 5}
BAD_CONSTRAINTS = [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": 7}}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"guided_regex": "(unclosed"}, "guided_regex"),
    ("/v1/chat/completions", {"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs.grammar"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("/v1/chat/completions", {"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"structured_outputs": {"json": {"type": "strin"}}}, "structured_outputs.json"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"tools": TOOLS}, "tool_choice"),  # auto needs --enable-auto-tool-choice
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": 3}}}], "tool_choice": "required"}, "tools"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
]


@pytest.mark.parametrize("path,extra,field", BAD_CONSTRAINTS, ids=[f"{p[4:]}-{f}" for p, _, f in BAD_CONSTRAINTS])
def test_a_malformed_constraint_is_a_400_naming_the_field(server, path, extra, field):
    body = {**({"prompt": "hi", "max_tokens": 5} if path == "/v1/completions" else CHAT), **extra}
    _assert_400(_post(server, path, body), field)


def test_tool_messages_are_accepted_and_a_bad_call_in_history_is_a_400(server):
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    response = _post(server, "/v1/chat/completions", {"messages": history, "max_tokens": 3, "tools": TOOLS,
                                                      "tool_choice": "none"})
    assert response.status_code == 200, response.text
    history[1]["tool_calls"][0]["function"]["arguments"] = "{oops"
    _assert_400(_post(server, "/v1/chat/completions", {"messages": history, "max_tokens": 3}),
                "messages.1.tool_calls.0.function.arguments")
