"""``qwen3_coder``: the XML tool calls of Qwen3-Coder (vLLM's parser of that name).

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Each value is text; it becomes the JSON type the tool's schema gives its parameter (``integer``, ``number``,
``boolean``, ``null``, and JSON for objects and arrays), and stays a string where the schema says
``string``, says nothing, or the text does not parse as that type. The text before the first call is
content. A call's arguments stream one parameter at a time, once the parameter's closing tag has arrived.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from dovetail.server.tool_parser_base import PartialCall, Reading, ToolParser, held_prefix

_STARTS = ("<tool_call>", "<function=")
_FUNCTION = "<function="
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def convert(value: str, schema: Optional[dict]) -> Any:
    """``value`` as the type ``schema`` gives it (see the module's docstring)."""
    kinds = (schema or {}).get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    text = value.strip()
    for kind in kinds:
        if kind == "string":
            return value
        if kind == "null" and text.lower() in ("null", "none"):
            return None
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind == "integer" and re.fullmatch(r"[-+]?\d+", text):
            return int(text)
        if kind == "number":
            try:
                number = float(text)
            except ValueError:
                continue
            return int(text) if re.fullmatch(r"[-+]?\d+", text) else number
        if kind in ("object", "array"):
            try:
                parsed = json.loads(text)
            except ValueError:
                continue
            if isinstance(parsed, dict if kind == "object" else list):
                return parsed
    return value


def _value(raw: str) -> str:
    """A parameter's text without the newline after its opening tag and before its closing one."""
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


class Qwen3CoderToolParser(ToolParser):
    """``<function=name><parameter=p>value</parameter>...</function>`` blocks, in ``<tool_call>`` or bare."""

    name = "qwen3_coder"

    def _properties(self, function: str) -> dict:
        for tool in self.tools:
            if tool.function.name == function:
                return (tool.function.parameters or {}).get("properties") or {}
        return {}

    def read(self, text: str, final: bool) -> Reading:
        found = [i for i in (text.find(start) for start in _STARTS) if i != -1]
        if not found:
            if final:
                return Reading(text)
            return Reading(text[:len(text) - max(held_prefix(text, start) for start in _STARTS)])
        first = min(found)
        calls = []
        for block in text[first:].split(_FUNCTION)[1:]:
            name, opened, body = block.partition(">")
            if not opened or "\n" in name:
                break  # calls are announced in order, each once its name is complete
            body, closed, _ = body.partition("</function>")
            properties = self._properties(name.strip())
            pairs = [f"{json.dumps(key.strip())}: "
                     f"{json.dumps(convert(_value(raw), properties.get(key.strip())), ensure_ascii=False)}"
                     for key, raw in _PARAMETER.findall(body)]
            calls.append(PartialCall(name.strip(), "{" + ", ".join(pairs) + ("}" if closed else ""), bool(closed)))
        return Reading(text[:first], calls)
