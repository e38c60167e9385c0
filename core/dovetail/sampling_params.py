"""SamplingParams: how to sample, with vLLM's field names; every field validated on construction."""

from __future__ import annotations

import enum
import json
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dovetail.config import format_validation_error
from dovetail.errors import RequestError

_EPS = 1e-5


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request holds (vLLM's names)."""

    CUMULATIVE = 0  # everything generated so far, at every step
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # one output, when the request finishes


#: The kinds of constraint of :class:`StructuredOutputsParams`, in vLLM's order.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputsParams(BaseModel):
    """A constraint on the generated text (vLLM's names): exactly one of ``json`` (a JSON schema, as a dict or
    a string), ``regex``, ``choice`` (a list of strings), ``grammar`` (EBNF, or Lark), ``json_object=True``
    (any JSON object) or ``structural_tag`` (xgrammar's structural tag, as a JSON string).

    ``disable_any_whitespace`` makes JSON compact (no free whitespace between its tokens); properties a schema
    does not name are refused unless it allows them (xgrammar's strict mode, so
    ``disable_additional_properties`` changes nothing). Invalid
    combinations raise :class:`dovetail.errors.RequestError`; an invalid schema, regex or grammar is found
    when the request is added.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    json_: Union[dict[str, Any], str, None] = Field(default=None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[str] = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None

    def __init__(self, **data):
        try:
            super().__init__(**data)
        except ValidationError as exc:
            loc = exc.errors()[0]["loc"]
            field = ".".join(["structured_outputs", *map(str, loc)])
            raise RequestError(format_validation_error(exc, prefix="structured_outputs.").replace(
                "structured_outputs.config:", "structured_outputs:"), field=field) from None

    @model_validator(mode="after")
    def _exactly_one(self):
        given = self.kinds()
        if len(given) != 1:
            detail = f"got {', '.join(given)}" if given else "got none"
            raise ValueError(f"give exactly one of {', '.join(STRUCTURED_KINDS)} ({detail})")
        if self.choice is not None and not self.choice:
            raise ValueError("choice: give at least one choice")
        if self.whitespace_pattern is not None:
            raise ValueError("whitespace_pattern: not supported (use disable_any_whitespace)")
        return self

    @property
    def json(self) -> Union[dict[str, Any], str, None]:  # noqa: A003 - vLLM's name
        return self.json_

    def kinds(self) -> list[str]:
        """The kinds of constraint given (a valid instance has exactly one)."""
        values = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                  "json_object": self.json_object or None, "structural_tag": self.structural_tag}
        return [kind for kind in STRUCTURED_KINDS if values[kind] is not None]

    @property
    def kind(self) -> str:
        return self.kinds()[0]

    def spec(self) -> tuple[str, str]:
        """``(kind, text)``: the constraint as a string (a schema serialised canonically), e.g. a cache key."""
        kind = self.kind
        if kind == "json":
            value = self.json_
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    return kind, value  # reported as invalid JSON when compiled
            return kind, json.dumps(value, ensure_ascii=False)  # key order is the order properties come in
        if kind == "choice":
            return kind, json.dumps(self.choice, ensure_ascii=False)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)


class SamplingParams(BaseModel):
    """Sampling parameters for one request (vLLM's names, defaults and rules).

    Invalid values raise :class:`dovetail.errors.RequestError` naming the field.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    n: int = Field(default=1, ge=1, le=1024)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: Optional[int] = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    logit_bias: Optional[dict[int, float]] = None
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: Optional[int] = Field(default=16, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    logprobs: Optional[int] = Field(default=None, ge=0)
    prompt_logprobs: Optional[int] = Field(default=None, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __init__(self, **data):
        try:
            super().__init__(**data)
        except ValidationError as exc:
            nested = (exc.errors()[0].get("ctx") or {}).get("error")
            if isinstance(nested, RequestError):  # from StructuredOutputsParams, which names its own field
                raise RequestError(f"invalid SamplingParams: {nested}", field=nested.field) from None
            raise RequestError(f"invalid SamplingParams: {format_validation_error(exc)}",
                               field=_first_field(exc)) from None

    def __setattr__(self, name, value):
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            raise RequestError(f"invalid SamplingParams: {format_validation_error(exc)}",
                               field=_first_field(exc)) from None

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, v):
        if v is not None and not (-(2**63) <= v < 2**64):
            raise ValueError("must fit in 64 bits")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        if isinstance(v, list) and any(not s for s in v):
            raise ValueError("stop strings must not be empty")
        if isinstance(v, str) and not v:
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v):
        if v:
            for token, bias in v.items():
                if token < 0:
                    raise ValueError(f"token id {token} must be >= 0")
                if not -100.0 <= bias <= 100.0:
                    raise ValueError(f"bias {bias} for token {token} must be between -100 and 100")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v):
        if v and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    @field_validator("min_tokens")
    @classmethod
    def _min_not_above_max(cls, value, info):
        max_tokens = info.data.get("max_tokens")
        if max_tokens is not None and value > max_tokens:
            raise ValueError(f"must be <= max_tokens ({max_tokens})")
        return value

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS

    def child(self, index: int) -> "SamplingParams":
        """The parameters of the ``index``-th of ``n`` samples (its own seed when seeded)."""
        seed = None if self.seed is None else self.seed + index
        return self.model_copy(update={"n": 1, "seed": seed})

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Reject token ids outside the model's vocabulary."""
        for field, ids in (("logit_bias", list((self.logit_bias or {}).keys())),
                           ("stop_token_ids", self.stop_token_ids or [])):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise RequestError(f"{field}: token id {bad[0]} is out of the vocabulary (size {vocab_size})",
                                   field=field)


class RequestParams(BaseModel):
    """Frozen per-request parameters whose invalid values raise :class:`RequestError` naming the field (the
    base of :class:`dovetail.pooling.PoolingParams` and :class:`dovetail.beam_search.BeamSearchParams`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def __init__(self, **data):
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise RequestError(format_validation_error(exc), field=_first_field(exc)) from None


def _first_field(exc: ValidationError) -> str | None:
    errors = exc.errors()
    if errors and errors[0]["loc"]:
        return str(errors[0]["loc"][0])
    return None
