"""Tool-call and reasoning parsers on fixed texts: whole, and streamed a character at a time (the stream
must add up to the whole answer, and never send what it would have to take back)."""

from __future__ import annotations

import json

import pytest

from dovetail.reasoning import FORMATS, ReasoningParser
from dovetail.server.chat_output import ChatOutput
from dovetail.server.protocol import ChatCompletionRequest
from dovetail.server.tool_parsers import (RequiredToolParser, ToolCallStream, final_calls, get_tool_parser,
                                          tool_parser_names)
from dovetail.server.tools import output_tool_parser

WEATHER = {"city": "Paris", "days": {"from": 1, "to": 3}, "note": "a } and a \" inside"}
TIME = {"zone": "UTC"}

CASES = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": %s}\n</tool_call>\n'
               '<tool_call>\n{"arguments": %s, "name": "get_time"}\n</tool_call>' % (json.dumps(WEATHER),
                                                                                      json.dumps(TIME)),
     "Let me look.\n", [("get_weather", WEATHER), ("get_time", TIME)]),
    ("llama3_json", '{"name": "get_weather", "parameters": %s}; {"name": "get_time", "parameters": %s}'
     % (json.dumps(WEATHER), json.dumps(TIME)), None, [("get_weather", WEATHER), ("get_time", TIME)]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "arguments": %s}' % json.dumps(TIME), None,
     [("get_time", TIME)]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": %s}, {"name": "get_time", "arguments": %s}]'
     % (json.dumps(WEATHER), json.dumps(TIME)), "Sure. ", [("get_weather", WEATHER), ("get_time", TIME)]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]%s[TOOL_CALLS]get_time[ARGS]%s' % (json.dumps(WEATHER),
                                                                                json.dumps(TIME)),
     None, [("get_weather", WEATHER), ("get_time", TIME)]),
]


def _stream(parser, text: str) -> tuple[str, dict]:
    stream = ToolCallStream(parser)
    content, calls = "", {}
    for end in range(1, len(text) + 1):
        piece, deltas = stream.update(text[:end], final=end == len(text))
        content += piece
        for delta in deltas:
            call = calls.setdefault(delta["index"], {"name": None, "arguments": ""})
            if "id" in delta:
                assert call["name"] is None and delta["type"] == "function"
                call["name"] = delta["function"]["name"]
            call["arguments"] += delta["function"].get("arguments", "")
    return content, calls


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_tool_calls_whole_and_streamed(name, text, content, calls):
    parser = get_tool_parser(name)
    got_content, got_calls = final_calls(parser, text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    assert len({c["id"] for c in got_calls}) == len(calls)
    if name == "mistral":
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in got_calls)
    streamed_content, streamed_calls = _stream(parser, text)
    assert streamed_content == (content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls.values()] == calls


@pytest.mark.parametrize("name", tool_parser_names())
def test_text_without_tool_calls_is_content(name):
    parser = get_tool_parser(name)
    for text in ("The weather is fine.", "<tool_call>{not json}</tool_call>", "{not a call"):
        assert final_calls(parser, text) is None
    content, calls = _stream(parser, "Hello <tool_ there")
    assert content == "Hello <tool_ there" and calls == {}


def test_a_partial_start_tag_is_held_back_while_streaming():
    stream = ToolCallStream(get_tool_parser("hermes"))
    assert stream.update("Hi <tool_", final=False) == ("Hi ", [])
    assert stream.update("Hi <tool_c", final=False) == ("", [])
    assert stream.update("Hi <tool_cat>", final=False) == ("<tool_cat>", [])


def test_required_tool_choice_output():
    text = json.dumps([{"name": "get_weather", "parameters": WEATHER}, {"name": "get_time", "parameters": TIME}])
    content, calls = final_calls(RequiredToolParser(), text)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    _, streamed = _stream(RequiredToolParser(), text)
    assert [json.loads(c["arguments"]) for c in streamed.values()] == [WEATHER, TIME]


CODER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "object"}, "count": {"type": "integer"},
        "ratio": {"type": "number"}, "metric": {"type": "boolean"}, "tags": {"type": "array"},
        "code": {"type": "string"}, "note": {"type": ["integer", "null"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}}}}]


def _coder_parser(tools=CODER_TOOLS):
    """The qwen3_coder parser as the server makes it for a request with ``tools``."""
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools)
    return output_tool_parser(body, "auto", "qwen3_coder")


def _xml_call(name: str, parameters: dict) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen3_coder_calls_are_typed_by_the_tools_schemas():
    text = "I will check.\n" + _xml_call("get_weather", {
        "city": "Paris", "days": '{"from": 1, "to": 3}', "count": "3", "ratio": "0.5", "metric": "True",
        "tags": '["a", "b"]', "code": "007", "note": "null"}) + "\n" + _xml_call("get_time", {"zone": "UTC"})
    expected = [("get_weather", {"city": "Paris", "days": {"from": 1, "to": 3}, "count": 3, "ratio": 0.5,
                                 "metric": True, "tags": ["a", "b"], "code": "007", "note": None}),
                ("get_time", {"zone": "UTC"})]
    content, calls = final_calls(_coder_parser(), text)
    assert content == "I will check.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == expected
    streamed_content, streamed = _stream(_coder_parser(), text)
    assert streamed_content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == expected


def test_qwen3_coder_text_that_does_not_parse_stays_a_string():
    text = _xml_call("get_weather", {"count": "three", "city": "Paris\nFrance", "ratio": "1e3", "unknown": "7"})
    _, (call,) = final_calls(_coder_parser(), text)
    assert json.loads(call["function"]["arguments"]) == {"count": "three", "city": "Paris\nFrance", "ratio": 1000.0,
                                                         "unknown": "7"}
    _, (untyped,) = final_calls(get_tool_parser("qwen3_coder"), text)  # no tools: every value is text
    assert json.loads(untyped["function"]["arguments"])["ratio"] == "1e3"
    assert final_calls(_coder_parser(), text[:text.index("</function>")]) is None  # cut short: not a call


class _Vocab:
    def get_vocab(self):
        return {"<think>": 7, "</think>": 8, "a": 1}


@pytest.mark.parametrize("name,text,prompt,reasoning,content", [
    ("qwen3", "<think>step one</think>The answer.", [1], "step one", "The answer."),
    ("qwen3", "\n<think>step one</think>", [1], "step one", None),
    ("qwen3", "The answer.", [1], None, "The answer."),
    ("qwen3", "step one</think>The answer.", [1, 7], "step one", "The answer."),  # the template opened it
    ("qwen3", "<think>cut short", [1], "cut short", None),
    ("deepseek_r1", "step one</think>The answer.", [1], "step one", "The answer."),
    ("deepseek_r1", "still thinking", [1], "still thinking", None),
    ("deepseek_r1", "<think>a</think>b", [1], "a", "b"),
])
def test_reasoning_whole_and_streamed(name, text, prompt, reasoning, content):
    parser = ReasoningParser(name, _Vocab())
    opens = parser.prompt_opens_reasoning(prompt)
    assert parser.split(text, opens) == (reasoning, content)
    stream = parser.stream(opens)
    pieces = [stream.update(text[:end], final=end == len(text)) for end in range(1, len(text) + 1)]
    assert "".join(r for r, _ in pieces) == (reasoning or "")
    assert "".join(c for _, c in pieces) == (content or "")
    assert not any("<" in r for r, _ in pieces if r)  # no tag leaks into the reasoning


def test_reasoning_tags_must_be_tokens():
    from dovetail.errors import ConfigError

    class Plain:
        def get_vocab(self):
            return {"a": 1}

    with pytest.raises(ConfigError, match="reasoning_parser: qwen3 needs '<think>' and '</think>'"):
        ReasoningParser("qwen3", Plain())
    assert sorted(FORMATS) == ["deepseek_r1", "qwen3"]
    parser = ReasoningParser("qwen3", _Vocab())
    assert parser.prompt_ends_reasoning([1, 7, 8, 1]) and not parser.prompt_ends_reasoning([1, 8, 7])


def test_a_chat_message_with_reasoning_and_tool_calls():
    text = '<think>plan</think>ok <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    output = ChatOutput(ReasoningParser("qwen3", _Vocab()), [1], get_tool_parser("hermes"))
    message, reason = output.message(text, "stop")
    assert reason == "tool_calls" and message["reasoning_content"] == "plan" and message["content"] == "ok "
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"x": 1}
    stream = output.stream()
    deltas = [stream.delta(text[i:i + 3], final=i + 3 >= len(text)) for i in range(0, len(text), 3)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "plan"
    assert "".join(d.get("content", "") for d in deltas) == "ok "
    assert stream.finish_reason("stop") == "tool_calls" and stream.finish_reason("length") == "length"
