"""The request fields that constrain output, as one :class:`StructuredOutputsParams`.

A request may constrain its output through OpenAI's ``response_format``
(``json_object``, or ``json_schema`` with its ``schema``), vLLM's
``structured_outputs`` object, or vLLM's older ``guided_json``, ``guided_regex``,
``guided_choice`` and ``guided_grammar``; chat's named or ``required``
``tool_choice`` constrains it to the tools' arguments. One constraint at most:
two are a 400 naming the second. A malformed schema, regex or grammar is a 400
naming the field it came in.
"""

from __future__ import annotations

from typing import Optional

from dovetail.engine.grammar import parse_grammar
from dovetail.errors import RequestError
from dovetail.sampling_params import StructuredOutputsParams

#: vLLM's older fields and the kind of constraint each gives.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class Constraint:
    """A constraint and the request field it came from (named in errors)."""

    def __init__(self, params: StructuredOutputsParams, field: str):
        self.params, self.field = params, field

    def check(self) -> StructuredOutputsParams:
        """Parse the grammar now (a 400 naming the field if malformed); the engine reuses the parse."""
        parse_grammar(self.params, self.field)
        return self.params


def _params(field: str, **values) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**values)
    except RequestError as exc:
        raise RequestError(str(exc).replace("structured_outputs", field, 1), field=field) from None


def request_constraints(body) -> list[Constraint]:
    """Every constraint ``body`` asks for, in the order of its fields."""
    found = []
    raw = getattr(body, "structured_outputs", None)
    if raw is not None:
        if not isinstance(raw, dict):
            raise RequestError("structured_outputs: must be an object", field="structured_outputs")
        params = _params("structured_outputs", **raw)
        found.append(Constraint(params, f"structured_outputs.{params.kind}"))
    whitespace = {"disable_any_whitespace": True} if getattr(body, "guided_whitespace_pattern", None) == "" else {}
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(body, name, None)
        if value is not None:
            found.append(Constraint(_params(name, **{kind: value}, **whitespace), name))
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        found.append(Constraint(_params("response_format", json_object=True), "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise RequestError("response_format.json_schema.schema: required when type is 'json_schema'",
                               field="response_format.json_schema.schema")
        found.append(Constraint(_params("response_format.json_schema.schema", json=fmt.json_schema.json_schema),
                                "response_format.json_schema.schema"))
    return found


def structured_outputs_of(body, tool_constraint: Optional[Constraint] = None) -> Optional[StructuredOutputsParams]:
    """The one constraint of ``body`` (checked), or None."""
    found = request_constraints(body)
    if tool_constraint is not None:
        found.append(tool_constraint)
    if len(found) > 1:
        others = ", ".join(c.field for c in found[:-1])
        field = found[-1].field.split(".")[0] if tool_constraint is None else "tool_choice"
        raise RequestError(f"{field}: only one constraint on the output may be given (also given: {others})",
                           field=field)
    return found[0].check() if found else None

