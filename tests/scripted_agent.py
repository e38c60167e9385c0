"""The scripted agent model the tool-calling, reasoning, Responses and Anthropic Messages tests share, and the
one ``dovetail serve`` of it they all talk to.

The model (:func:`tiny_models.save_scripted_model`) thinks ``<think>...</think>`` and then calls
``get_weather`` in a ``<tool_call>`` block, so the server's parsers (``--reasoning-parser qwen3
--enable-auto-tool-choice --tool-call-parser hermes``) have a known text to split. It reports cached prompt
tokens (``--enable-prompt-tokens-details``) and keeps
``/v1/responses`` (``DOVETAIL_ENABLE_RESPONSES_API_STORE``), at most ``STORE_MAX`` of them.
"""

from __future__ import annotations

import json

import tiny_models
from test_server_cli import API_KEY, ServerProcess, shared_server

REASONING = "I should look up the weather."
ARGUMENTS = {"city": "Paris", "unit": "celsius"}
CALL = "\n" + json.dumps({"name": "get_weather", "arguments": ARGUMENTS}) + "\n"
SCRIPT = ["<think>", REASONING, "</think>", "<tool_call>", CALL, "</tool_call>"]
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"},
                                               "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}
QUESTION = "What is the weather in Paris?"
MAX_MODEL_LEN = 512
STORE_MAX = 3

_MODEL_DIR: list = []


def agent_server(tmp_path_factory) -> ServerProcess:
    """The session's server of the scripted model (started by the first test module that asks)."""
    if not _MODEL_DIR:
        _MODEL_DIR.append(tiny_models.save_scripted_model(tmp_path_factory.mktemp("scripted"), SCRIPT))
    return shared_server(_MODEL_DIR[0], "--api-key", API_KEY, "--served-model-name", "scripted",
                         "--max-model-len", str(MAX_MODEL_LEN), "--reasoning-parser", "qwen3",
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-prompt-tokens-details",
                         env={"DOVETAIL_ENABLE_RESPONSES_API_STORE": "true",
                              "DOVETAIL_RESPONSES_API_STORE_MAX": str(STORE_MAX)})
