"""A structured-outputs constraint as an xgrammar ``Grammar``: parsed (not yet compiled) and checked.

Parsing is cheap next to compiling against the vocabulary, so it happens where the
request is made, and a malformed schema, regex or grammar is reported there,
naming the field. Parsed grammars are kept per distinct constraint.
"""

from __future__ import annotations

import functools
import json
import re

from dovetail.errors import RequestError
from dovetail.sampling_params import StructuredOutputsParams

# xgrammar's messages start with a time stamp and a source location, e.g. "[12:00:00] /x/y.cc:83: ".
_LOCATION = re.compile(r"^\[[\d:]+\] [^:]+:\d+: ")
_CHECK = re.compile(r"^Check failed: \(.*?\) is false: ")


def xgrammar_message(exc: BaseException) -> str:
    """xgrammar's explanation of a failure, without its source location."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return _CHECK.sub("", _LOCATION.sub("", text)).strip()


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar that matches exactly one of ``choices``."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _is_lark(grammar: str) -> bool:
    """vLLM's rule: a grammar without ``::=`` rules is Lark, otherwise EBNF."""
    return "::=" not in grammar


def _structural_tag(xgr, text: str):
    value = json.loads(text)
    if isinstance(value, dict) and "structures" in value:  # the older form vLLM also takes
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in value["structures"]]
        return xgr.Grammar.from_structural_tag(items, value["triggers"])
    return xgr.Grammar.from_structural_tag(text)


@functools.lru_cache(maxsize=512)
def _parse(kind: str, text: str, any_whitespace: bool):
    import xgrammar as xgr

    if kind == "json":
        return xgr.Grammar.from_json_schema(text, any_whitespace=any_whitespace)
    if kind == "json_object":
        return xgr.Grammar.builtin_json_grammar()
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(text)))
    if kind == "grammar":
        return xgr.Grammar.from_lark(text) if _is_lark(text) else xgr.Grammar.from_ebnf(text)
    if kind == "structural_tag":
        return _structural_tag(xgr, text)
    raise AssertionError(kind)


_WHAT = {"json": "JSON schema", "regex": "regular expression", "grammar": "grammar", "choice": "choice",
         "structural_tag": "structural tag", "json_object": "JSON grammar"}


def parse_grammar(spec: StructuredOutputsParams, field: str | None = None):
    """The xgrammar ``Grammar`` of ``spec``; a :class:`RequestError` naming ``field`` (default
    ``structured_outputs.<kind>``) if it is malformed."""
    kind, text = spec.spec()
    field = field or f"structured_outputs.{kind}"
    try:
        return _parse(kind, text, not spec.disable_any_whitespace)
    except Exception as exc:  # xgrammar raises RuntimeError, ValueError and its own errors alike
        raise RequestError(f"{field}: invalid {_WHAT[kind]}: {xgrammar_message(exc)}", field=field) from None

