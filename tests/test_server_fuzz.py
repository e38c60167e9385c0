"""Property-based fuzzing of the server's OpenAPI schema with schemathesis: no input may cause a 5xx.

Cases come from the schema the server publishes (``/openapi.json``), both
valid ones and ones that break it (wrong types, missing fields, out-of-range
values). Only ``n`` and the token budgets are capped, to keep each example
fast; every other value is sent as generated. ``DOVETAIL_FUZZ_EXAMPLES``
raises the number of examples for a deeper run.
"""

from __future__ import annotations

import os
import re
import time

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from test_server_cli import MAIN_FLAGS, auth, shared_server  # noqa: E402

MAX_EXAMPLES = int(os.environ.get("DOVETAIL_FUZZ_EXAMPLES", "150"))


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    return shared_server(tiny_llama_dir, *MAIN_FLAGS)


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url("/openapi.json"), headers=auth())


def _cap(body):
    """Bound the work an example asks for (the values stay of the generated type)."""
    if not isinstance(body, dict):
        return
    for key, limit in (("n", 3), ("max_tokens", 16), ("max_completion_tokens", 16), ("max_output_tokens", 16),
                       ("min_tokens", 16)):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            body[key] = limit
    if "max_tokens" not in body and "max_completion_tokens" not in body and "messages" in body:
        body["max_completion_tokens"] = 16
    if "input" in body and "max_output_tokens" not in body:
        body["max_output_tokens"] = 16


def _greedy(server):
    body = {"prompt": "hello world", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return httpx.post(server.url("/v1/completions"), json=body, headers=auth(), timeout=60).json()["choices"][0]["text"]


def test_schema_fuzz_finds_no_server_error(api_schema, server):
    operations = {f"{op.ok().method.upper()} {op.ok().path}" for op in api_schema.get_all_operations()}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize",
            "GET /v1/models"} <= operations
    before = _greedy(server)
    seen: dict[int, int] = {}
    strategy = st.one_of(api_schema.as_strategy(GenerationMode.POSITIVE),
                         api_schema.as_strategy(GenerationMode.NEGATIVE))

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def check(case):
        _cap(case.body)
        response = case.call(base_url=server.base_url, headers=auth(), timeout=120)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, f"{case.as_curl_command()}\n-> {response.status_code} {response.text}"
        if response.status_code >= 400:  # every error is OpenAI's JSON
            error = response.json()["error"]
            assert error["type"] and re.match(r"^[\w.]+: ", error["message"]), response.text  # names the field

    check()
    assert any(200 <= s < 300 for s in seen) and any(s == 400 for s in seen), seen
    # The engine loop survived every case, freed every block, and still generates the same text.
    deadline = time.monotonic() + 30
    while "dovetail_kv_cache_usage_perc 0.0" not in httpx.get(server.url("/metrics"), headers=auth()).text:
        assert time.monotonic() < deadline, "KV-cache blocks were not freed after the fuzz"
        time.sleep(0.1)
    assert httpx.get(server.url("/health")).status_code == 200
    assert _greedy(server) == before
