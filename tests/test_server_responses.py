"""``/v1/responses`` (OpenAI's Responses API) through the ``openai`` client against ``dovetail serve`` with
``--reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser hermes`` and the response store on.

The model is scripted (:func:`tiny_models.save_scripted_model`): it thinks ``<think>...</think>`` and then
calls ``get_weather`` in a ``<tool_call>`` block. Each Responses request is checked against the chat
completion of the same conversation: the same prompt tokens (so the translation of ``input``,
``instructions``, tools and ``previous_response_id`` into messages is the one a chat client would send) and
the same output, split into reasoning, message and function-call items.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from scripted_agent import ARGUMENTS, CALL, MAX_MODEL_LEN, PARAMETERS, QUESTION, REASONING, STORE_MAX, agent_server
from test_server_cli import auth

TOOLS = [{"type": "function", "name": "get_weather", "description": "the forecast", "parameters": PARAMETERS}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast",
                                                "parameters": PARAMETERS}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    return agent_server(tmp_path_factory)


def _chat(client, messages, **kwargs):
    return client.chat.completions.create(model="scripted", messages=messages, max_tokens=20, **kwargs)


def _create(client, **kwargs):
    return client.responses.create(model="scripted", **{"max_output_tokens": 20, **kwargs})


def _stream(client, **kwargs):
    """Every event of a streamed response, and the SDK's final response assembled from them."""
    with client.responses.stream(model="scripted", **{"max_output_tokens": 20, **kwargs}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    return events, final


def _answered(call) -> list[dict]:
    """The chat messages of the question, the model's ``call`` and its output, "18 degrees"."""
    return [{"role": "user", "content": QUESTION},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees"}]


def _items(response) -> dict:
    return {item.type: item for item in response.output}


def test_text_output_splits_reasoning_from_the_message(client):
    chat = _chat(client, [{"role": "user", "content": QUESTION}])
    response = _create(client, input=QUESTION)
    assert response.status == "completed" and response.object == "response" and response.id.startswith("resp_")
    assert [item.type for item in response.output] == ["reasoning", "message"]
    reasoning, message = response.output
    assert reasoning.content[0].text == REASONING == chat.choices[0].message.reasoning_content
    assert message.role == "assistant" and message.status == "completed"
    assert response.output_text == chat.choices[0].message.content == f"<tool_call>{CALL}</tool_call>"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    assert response.store is True and response.tool_choice == "none" and response.text.format.type == "text"


def test_stream_sends_each_item_and_its_deltas_in_order(client):
    events, final = _stream(client, input=QUESTION)
    whole = _create(client, input=QUESTION)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed" and final.status == "completed"
    reasoning_deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text_deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert reasoning_deltas == REASONING and text_deltas == whole.output_text == final.output_text
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    done = [e.item.id for e in events if e.type == "response.output_item.done"]
    assert added == done == [item.id for item in final.output]
    message = kinds.index("response.content_part.added")
    assert kinds.index("response.output_item.added", 3) < message < kinds.index("response.output_text.delta")
    assert kinds.index("response.output_text.done") < kinds.index("response.content_part.done")
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_tool_calls_are_function_call_items_and_their_outputs_continue_the_conversation(client):
    response = _create(client, input=QUESTION, tools=TOOLS, instructions="Answer briefly.")
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    call = _items(response)["function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == ARGUMENTS and call.call_id
    assert response.tool_choice == "auto" and response.instructions == "Answer briefly."
    chat = _chat(client, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}],
                 tools=CHAT_TOOLS)
    assert response.usage.input_tokens == chat.usage.prompt_tokens

    events, final = _stream(client, input=QUESTION, tools=TOOLS)
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(arguments) == ARGUMENTS
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == arguments and done.name == "get_weather"
    assert _items(final)["function_call"].arguments == arguments

    follow_up = [{"role": "user", "content": QUESTION},
                 {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                 {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"}]
    answered = _create(client, input=follow_up, tools=TOOLS)
    assert answered.usage.input_tokens == _chat(client, _answered(call), tools=CHAT_TOOLS).usage.prompt_tokens


def test_previous_response_id_continues_a_stored_response(client):
    first = _create(client, input=QUESTION, tools=TOOLS, instructions="Answer briefly.")
    call = _items(first)["function_call"]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"}
    second = _create(client, previous_response_id=first.id, input=[output], tools=TOOLS)
    assert second.previous_response_id == first.id and second.instructions is None
    assert second.usage.input_tokens == _chat(client, _answered(call), tools=CHAT_TOOLS).usage.prompt_tokens

    _, streamed = _stream(client, previous_response_id=second.id, input="And tomorrow?")
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    deleted = httpx.delete(f"{client.base_url}responses/{first.id}", headers=auth())
    assert deleted.status_code == 200 and deleted.json() == {"id": first.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)

    unstored = _create(client, input=QUESTION, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    kept = [_create(client, input=QUESTION).id for _ in range(STORE_MAX)]
    with pytest.raises(openai.NotFoundError):  # the oldest are forgotten beyond the store's capacity
        client.responses.retrieve(second.id)
    assert [client.responses.retrieve(i).id for i in kept] == kept


def test_text_format_constrains_the_message(client):
    choices = ["sunny", "rainy"]
    response = _create(client, input=QUESTION, text={"format": {
        "type": "json_schema", "name": "forecast", "schema": {"enum": choices}}})
    assert _items(response)["reasoning"].content[0].text == REASONING  # the reasoning ran free
    assert json.loads(response.output_text) in choices
    assert response.text.format.type == "json_schema" and response.text.format.name == "forecast"


def test_max_output_tokens_leaves_the_response_incomplete(client):
    response = _create(client, input=QUESTION, max_output_tokens=2)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2 and response.output[-1].status == "incomplete"
    events = list(client.responses.create(model="scripted", input=QUESTION, max_output_tokens=2, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert events[-1].response.output[-1].status == "incomplete"


def test_auto_truncation_leaves_out_the_oldest_messages(client, server):
    long_turns = []
    for i in range(6):
        long_turns += [{"role": "user", "content": f"question {i} " + "weather " * 60},
                       {"role": "assistant", "content": "answer " * 20}]
    conversation = [*long_turns, {"role": "user", "content": QUESTION}]
    refused = _post(server, input=conversation)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input"
    response = _create(client, input=conversation, truncation="auto")
    assert response.status == "completed" and response.truncation == "auto"
    assert response.usage.input_tokens + 20 <= MAX_MODEL_LEN
    assert response.output_text == f"<tool_call>{CALL}</tool_call>"


def _post(server, **body) -> httpx.Response:
    return httpx.post(server.url("/v1/responses"), headers=auth(), timeout=60,
                      json={"model": "scripted", **body})


@pytest.mark.parametrize("body, param", [
    ({"input": QUESTION, "max_output_tokens": 600}, "max_output_tokens"),
    ({"input": QUESTION, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": QUESTION, "text": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
     "text.format.schema"),
    ({"input": QUESTION, "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": QUESTION, "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": QUESTION, "tools": [{**TOOLS[0], "parameters": {"type": "nonsense"}}],
      "tool_choice": "required"}, "tools"),
    ({"input": QUESTION, "background": True}, "background"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"role": "user", "content": QUESTION},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{"}]},
     "input.1.arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"input": QUESTION, "model": "other"}, "model"),
])
def test_bad_requests_are_400s_naming_the_responses_field(server, body, param):
    response = _post(server, **body)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error


def test_unknown_previous_response_and_unknown_ids_are_404s(server):
    response = _post(server, input=QUESTION, previous_response_id="resp_missing")
    assert response.status_code == 404 and response.json()["error"]["param"] == "previous_response_id"
    for method in (httpx.get, httpx.delete):
        missing = method(server.url("/v1/responses/resp_missing"), headers=auth())
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "response_not_found"


def test_store_is_off_unless_the_environment_asks():
    from dovetail.server.response_store import ResponseStore, StoredResponse

    assert ResponseStore.from_environment({}) is None
    assert ResponseStore.from_environment({"DOVETAIL_ENABLE_RESPONSES_API_STORE": "0"}) is None
    store = ResponseStore.from_environment({"DOVETAIL_ENABLE_RESPONSES_API_STORE": "true",
                                            "DOVETAIL_RESPONSES_API_STORE_MAX": "2"})
    for i in range(3):
        store.put(StoredResponse({"id": f"r{i}"}, []))
    assert store.get("r0") is None and store.get("r2") is not None and len(store) == 2
    with pytest.raises(ValueError, match="DOVETAIL_RESPONSES_API_STORE_MAX"):
        ResponseStore.from_environment({"DOVETAIL_ENABLE_RESPONSES_API_STORE": "1",
                                        "DOVETAIL_RESPONSES_API_STORE_MAX": "many"})
