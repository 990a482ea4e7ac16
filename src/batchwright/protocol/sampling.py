"""What completion and chat requests share: the sampling parameters, their checks, and how a
failed check becomes an OpenAI error object naming the parameter. Torch-free.

`CheckedRequest.check` is each endpoint's body check (`check_completion_body`,
`check_chat_body`, and `check_embedding_body` too: the embeddings request shares the check
and its messages, not the sampling parameters): a body becomes a request or a 400 with one
message. Where several parameters are wrong, the first in the endpoint's wire order
(`PARAMS`) is the one reported.
"""

from __future__ import annotations

import re
import reprlib
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from batchwright.protocol.response_format import ResponseFormat

# fail_fast: a list of a million wrong items is one error, not a million built for every
# branch of the union (gigabytes and a minute for a 4 MB prompt of floats).
Strings = Annotated[list[str], Field(fail_fast=True)]

INT64 = 2**63
MAX_TOKENS = 2**31 - 1
# A logit_bias key is a token id in ASCII digits: str.isdigit() also accepts "²" or "①",
# which int() rejects, and a key of thousands of digits is over int()'s own limit.
_TOKEN_ID = re.compile(r"[0-9]{1,12}")
_STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})
# Values quoted back in error messages: bounded in depth and length, so a body nested a
# thousand levels deep (or a megabyte string) gives a short message, not a RecursionError.
_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother, _SHOW.maxlist, _SHOW.maxdict = 3, 80, 80, 6, 6


def show(value: Any) -> str:
    return _SHOW.repr(value)


# Characters of one stop sequence. Every step of a row holds back what may still become
# one (engine/text/stop.py); a megabyte stop made that hold-back, and the search, the row's
# biggest cost. Longer than any delimiter a prompt format or eval harness uses.
MAX_STOP_CHARS = 1024


def check_stop(v: str | list[str] | None) -> str | list[str] | None:
    items = [v] if isinstance(v, str) else (v or [])
    if len(items) > 4:
        raise ValueError(f"at most 4 stop sequences are allowed, got {len(items)}")
    if any(s == "" for s in items):
        raise ValueError("stop sequences must be non-empty strings")
    if any(len(s) > MAX_STOP_CHARS for s in items):
        longest = max(len(s) for s in items)
        raise ValueError(
            f"a stop sequence may be at most {MAX_STOP_CHARS} characters long, got {longest}"
        )
    return v


def check_logit_bias(v: dict[str, float] | None) -> dict[str, float] | None:
    for key, bias in (v or {}).items():
        if not _TOKEN_ID.fullmatch(key):
            raise ValueError(f"keys must be token ids (non-negative integers), got {show(key)}")
        if not -100.0 <= bias <= 100.0:
            raise ValueError(f"bias for token {key} is {bias}, outside the range -100 to 100")
    return v


def logit_bias_numbers(v: Any) -> Any:
    """Before pydantic's own pass, which makes an error of every entry that is no number
    (a million of them for a body of a few megabytes): the first one is enough."""
    if isinstance(v, dict):
        for key, bias in v.items():
            if isinstance(bias, bool) or not isinstance(bias, int | float):
                raise ValueError(f"bias for token {show(key)} is {show(bias)}, not a number")
    return v


def check_stream_options(v: dict[str, Any] | None) -> dict[str, Any] | None:
    for key, value in (v or {}).items():
        if key not in _STREAM_OPTIONS:
            raise ValueError(f"unknown option {show(key)} (known: include_usage)")
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be a boolean, got {show(value)}")
    return v


def online(info: ValidationInfo) -> bool:
    """Validated as the body of a POST to the endpoint (not a batch line)."""
    return bool(info.context and info.context.get("online"))


def request_error(message: str, param: str | None, code: str | None = None) -> dict[str, Any]:
    return {"message": message, "type": "invalid_request_error", "param": param, "code": code}


_UNION_TAGS = frozenset({"str", "int", "float", "list[str]", "list[int]", "list[list[int]]"})


def locate(err: Any) -> tuple[str, str | None]:
    """Where a pydantic error is ("messages.0.content", or "body" for a check across
    parameters) and its parameter (None: across parameters)."""
    # Union branch names (e.g. "list[int]") are pydantic's, not the client's: drop them.
    loc = [str(p)[:64] for p in err.get("loc", ()) if str(p) not in _UNION_TAGS]
    return (".".join(loc) if loc else "body"), (loc[0] if loc else None)


def describe(err: Any) -> tuple[str, str | None]:
    """One pydantic error → (message naming parameter and value, param)."""
    where, param = locate(err)
    value = err.get("input")
    kind = err.get("type", "")
    ctx = err.get("ctx") or {}
    if kind == "missing":
        return f"Missing required parameter: '{where}'.", param
    if kind in ("less_than_equal", "less_than"):
        limit = ctx.get("le", ctx.get("lt"))
        return f"Invalid '{where}': {show(value)} is greater than the maximum of {limit}.", param
    if kind in ("greater_than_equal", "greater_than"):
        limit = ctx.get("ge", ctx.get("gt"))
        return f"Invalid '{where}': {show(value)} is less than the minimum of {limit}.", param
    if kind == "value_error":
        msg = str(ctx.get("error", err.get("msg", "")))
        if param is None:  # a check across parameters (SamplingRequest._conflict): "name: why"
            param, _, msg = msg.partition(": ")
            where = param
        return f"Invalid '{where}': {msg}.", param
    return f"Invalid '{where}': {show(value)} is not valid ({err.get('msg', kind)}).", param


def union_detail(errors: list[Any]) -> str:
    """Why a parameter that takes several shapes (a prompt, an input) fit none of them: the
    first of its own checks that failed, else the value."""
    for err in errors:
        if err.get("type") == "value_error":
            return str((err.get("ctx") or {}).get("error", err.get("msg")))
    return f"got {show(errors[0].get('input'))}"[:200]


class CheckedRequest(BaseModel):
    """A request body of any endpoint and its check (`check`): the parameters it knows, in
    wire order, null as the default, one OpenAI error object for what is wrong. A subclass
    says its parameters and may explain its own errors (`_explain`)."""

    # strict: "1" is not a number and true is not 1, as in OpenAI's API.
    model_config = ConfigDict(extra="forbid", strict=True)

    # Every parameter the endpoint knows, in wire order: where several are wrong, the
    # first of them in this order is the one reported.
    PARAMS: ClassVar[tuple[str, ...]]
    # OpenAI's parameters for features batchwright does not have (parameter → feature).
    UNSUPPORTED: ClassVar[Mapping[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @classmethod
    def check(
        cls,
        body: object,
        max_sequences: int | None = None,
        *,
        online: bool = False,
        check_schema: bool = False,
    ) -> tuple[Self | None, dict[str, Any] | None]:
        """Validate a body: (request, None) or (None, OpenAI error object).

        `max_sequences` caps prompts x best_of (or n) per line (`_too_many`: sampling
        requests only); None reads it from Settings.
        `online`: the body of a POST to the endpoint, where `stream` and `stream_options`
        are allowed; every other check (and its message) is the batch line's.
        `check_schema`: a response_format's schema is checked against the metaschema too
        (where bodies come in: protocol/endpoints.check_body)."""
        if not isinstance(body, dict):
            return None, request_error(
                "The request body must be a JSON object.", None, "invalid_body"
            )
        if (err := cls._refuse(body)) is not None:
            return None, err
        try:
            context = {"online": online, "check_schema": check_schema}
            req = cls.model_validate(body, context=context)
        except ValidationError as exc:
            message, param = cls._explain(cls._in_wire_order(exc.errors()))
            return None, request_error(message, param)
        err = req._too_many(max_sequences)
        return (req, None) if err is None else (None, err)

    @classmethod
    def _in_wire_order(cls, errors: list[Any]) -> list[Any]:
        """Pydantic reports errors in field order (the shared fields first): sorted by
        parameter in `PARAMS` order instead. An error across parameters (no loc) comes
        alone: those checks run only once every field is valid."""
        rank = {name: i for i, name in enumerate(cls.PARAMS)}
        return sorted(errors, key=lambda e: rank.get(str(e["loc"][0]), -1) if e["loc"] else -1)

    @classmethod
    def _refuse(cls, body: dict[str, Any]) -> dict[str, Any] | None:
        """The first parameter of the body that the endpoint does not know, as a 400."""
        for key in body:
            if key not in cls.PARAMS and key not in cls.UNSUPPORTED:
                return request_error(
                    f"Unrecognized request argument supplied: {key[:64]}", key[:64]
                )
        return None

    @classmethod
    def _explain(cls, errors: list[Any]) -> tuple[str, str | None]:
        """The validation errors (in wire order) → (message, param)."""
        return describe(errors[0])

    def _too_many(self, limit: int | None) -> dict[str, Any] | None:
        """A 400 for a body that asks for more than `limit` allows (None: nothing)."""
        return None


class SamplingRequest(CheckedRequest):
    """The parameters, defaults, ranges and checks of /v1/completions and
    /v1/chat/completions bodies alike. A subclass adds its endpoint's own parameters and
    says what its messages need: its wire order, what it refuses in a batch."""

    # What a batch line cannot have (stream, stream_options): "is not supported in a batch: …".
    NOT_IN_BATCH: ClassVar[str]

    model: str
    n: int = Field(default=1, ge=1, le=128)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    stop: str | Strings | None = None
    seed: int | None = Field(default=None, ge=-INT64, le=INT64 - 1)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    # An extension on /v1/completions: OpenAI takes it on chat only (response_format.py).
    response_format: ResponseFormat | None = None

    @field_validator("stop")
    @classmethod
    def _stop_shape(cls, v: str | list[str] | None) -> str | list[str] | None:
        return check_stop(v)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias_numbers(cls, v: Any) -> Any:
        return logit_bias_numbers(v)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_shape(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        return check_logit_bias(v)

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, v: bool | None, info: ValidationInfo) -> bool | None:
        if v and not online(info):
            raise ValueError(f"stream=true {cls.NOT_IN_BATCH}")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options(
        cls, v: dict[str, Any] | None, info: ValidationInfo
    ) -> dict[str, Any] | None:
        if v is not None and not online(info):
            raise ValueError(f"stream_options {cls.NOT_IN_BATCH}")
        return check_stream_options(v)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        why = self._conflict()
        if why is not None:
            raise ValueError(why)
        return self

    def _conflict(self) -> str | None:
        """The first check across parameters that fails, as "param: why" (None: none).
        As OpenAI: stream_options only with stream."""
        if self.stream_options is not None and not self.stream:
            return "stream_options: stream_options is only allowed when stream is true"
        return None

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    # Views the engine and the validation share.
    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def prompt_count(self) -> int:
        return 1

    @property
    def candidates(self) -> int:
        """Sequences generated per prompt (best_of of them ranked where it is set)."""
        return self.n

    @property
    def candidates_param(self) -> str:
        """The parameter `candidates` comes from."""
        return "n"

    @property
    def sequences(self) -> int:
        """Sequences this line runs: one per candidate of every prompt."""
        return self.prompt_count * self.candidates

    def _too_many(self, limit: int | None) -> dict[str, Any] | None:
        if limit is None:
            from batchwright.config import get_settings

            limit = get_settings().max_sequences_per_line
        if self.sequences <= limit:
            return None
        param = self.candidates_param
        return request_error(
            f"This line asks for {self.sequences} sequences ({self.prompt_count} prompts x "
            f"{param} {self.candidates}); the limit is {limit} sequences per line "
            "(prompts x best_of). Split the prompts over several lines.",
            param,
            "too_many_sequences",
        )
