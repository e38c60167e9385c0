"""Tool calling on chat completions: which tools reach the template, and how ``tool_choice`` shapes the output.

- ``none``: the model answers in text; the tools are not shown to it (vLLM's default).
- ``auto`` (the default when tools are given): the tools go to the chat template, and the
  server's ``--tool-call-parser`` finds the calls the model chose to make in its text.
- ``required``: the output is constrained to a JSON list of ``{"name", "parameters"}`` objects,
  one of the tools each (the schema vLLM builds).
- a named function: the output is constrained to that function's arguments.

Assistant messages with ``tool_calls`` and ``tool`` messages go to the template as
they came, except that arguments sent as a JSON string (as OpenAI clients do) are
parsed into an object, which is what chat templates expect.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from dovetail.errors import RequestError
from dovetail.sampling_params import StructuredOutputsParams
from dovetail.server.structured import Constraint
from dovetail.server.tool_parsers import NamedToolParser, RequiredToolParser, ToolParser, get_tool_parser

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def tool_choice_mode(body) -> str:
    """``none``, ``auto``, ``required`` or ``named``."""
    choice = body.tool_choice
    if choice is None:
        return "auto" if body.tools else "none"
    return choice if isinstance(choice, str) else "named"


def check_tool_choice(body, tool_parser: Optional[str]) -> str:
    """The mode of ``body``'s tool choice; a 400 for one that cannot be honoured."""
    mode = tool_choice_mode(body)
    if mode in ("required", "named") and not body.tools:
        raise RequestError(f"tool_choice: {mode!r} needs tools", field="tool_choice")
    if mode == "named":
        names = [t.function.name for t in body.tools]
        if body.tool_choice.function.name not in names:
            raise RequestError(f"tool_choice: function {body.tool_choice.function.name!r} is not among the tools "
                               f"({', '.join(names)})", field="tool_choice")
    if mode == "auto" and body.tools and tool_parser is None:
        raise RequestError('tool_choice: "auto" tool choice needs the server to run with --enable-auto-tool-choice '
                           "and --tool-call-parser", field="tool_choice")
    return mode


def template_tools(body) -> Optional[list[dict]]:
    """The tools as the chat template receives them (none when ``tool_choice`` is ``none``)."""
    if not body.tools or tool_choice_mode(body) == "none":
        return None
    return [tool.model_dump(exclude_none=True) for tool in body.tools]


def _tool_schema(tool) -> dict:
    return {"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                           "parameters": tool.function.parameters or EMPTY_PARAMETERS},
            "required": ["name", "parameters"]}


def tools_constraint(body, mode: str) -> Optional[Constraint]:
    """The constraint a named or ``required`` tool choice puts on the output."""
    if mode == "named":
        index = next(i for i, t in enumerate(body.tools) if t.function.name == body.tool_choice.function.name)
        schema = body.tools[index].function.parameters or EMPTY_PARAMETERS
        return Constraint(StructuredOutputsParams(json=schema), f"tools.{index}.function.parameters")
    if mode == "required":
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": {"type": "object", "anyOf": [_tool_schema(t) for t in body.tools]}}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        defs = {}
        for tool in body.tools:
            defs.update((tool.function.parameters or {}).get("$defs", {}))
        if defs:
            schema["$defs"] = defs
        return Constraint(StructuredOutputsParams(json=schema), "tools")
    return None


def output_tool_parser(body, mode: str, tool_parser: Optional[str]) -> Optional[ToolParser]:
    """The parser that reads tool calls from this request's output, if any."""
    if mode == "named":
        return NamedToolParser(body.tool_choice.function.name)
    if mode == "required":
        return RequiredToolParser()
    if mode == "auto" and body.tools and tool_parser is not None:
        return get_tool_parser(tool_parser, body.tools)
    return None


def template_messages(conversation: list[dict]) -> list[dict]:
    """Assistant tool calls with their arguments as objects, which chat templates print as JSON."""
    for i, message in enumerate(conversation):
        for j, call in enumerate(message.get("tool_calls") or []):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise RequestError(f"messages.{i}.tool_calls.{j}.function: needs a name and arguments",
                                   field=f"messages.{i}.tool_calls.{j}.function")
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    function["arguments"] = json.loads(arguments) if arguments.strip() else {}
                except ValueError:
                    raise RequestError(f"messages.{i}.tool_calls.{j}.function.arguments: not valid JSON",
                                       field=f"messages.{i}.tool_calls.{j}.function.arguments") from None
    return conversation
