"""The /v1/completions request and response models. Torch-free: the API validates with it.

`check_completion_body` turns a batch line's body into either a `CompletionRequest` or an
OpenAI error object that names the parameter and what is wrong with its value.
"""

from __future__ import annotations

import re
import reprlib
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from batchwright.protocol.base import OpenAIBaseModel
from batchwright.protocol.response_format import ResponseFormat

# fail_fast: a list of a million wrong items is one error, not a million built for every
# branch of the union (gigabytes and a minute for a 4 MB prompt of floats).
TokenIds = Annotated[list[int], Field(fail_fast=True)]
Strings = Annotated[list[str], Field(fail_fast=True)]
PromptType = str | Strings | TokenIds | Annotated[list[TokenIds], Field(fail_fast=True)]

# Every create parameter OpenAI documents for /v1/completions. `suffix`, `stream` and
# `stream_options` are known (so they get a precise message) but not supported in a batch;
# the online endpoint takes `stream` and `stream_options` (validated with online=True).
KNOWN_PARAMS = frozenset(
    {
        "model",
        "prompt",
        "best_of",
        "echo",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "max_tokens",
        "n",
        "presence_penalty",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "suffix",
        "temperature",
        "top_p",
        "user",
        # An extension: OpenAI takes it on chat only (protocol/response_format.py).
        "response_format",
    }
)
_NOT_IN_BATCH = "is not supported in a batch: /v1/completions lines run to completion server-side"
_NO_SUFFIX = "is not supported: the models served here complete text, they do not insert it"
_STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})

_INT64 = 2**63
MAX_TOKENS = 2**31 - 1
# A logit_bias key is a token id in ASCII digits: str.isdigit() also accepts "²" or "①",
# which int() rejects, and a key of thousands of digits is over int()'s own limit.
_TOKEN_ID = re.compile(r"[0-9]{1,12}")
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


class CompletionRequest(BaseModel):
    """A batch line body for /v1/completions, with OpenAI's defaults and ranges."""

    # strict: "1" is not a number and true is not 1, as in OpenAI's API.
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    prompt: PromptType
    # Above any model's context (a line asking more is a 400 at run time); the bound keeps
    # n x max_tokens, summed over a batch's lines for its quota, inside a bigint.
    max_tokens: int = Field(default=16, ge=0, le=MAX_TOKENS)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=128)
    best_of: int | None = Field(default=None, ge=1, le=20)
    stop: str | Strings | None = None
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, ge=-_INT64, le=_INT64 - 1)
    user: str | None = None
    suffix: str | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v: PromptType) -> PromptType:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be an empty list")
            for item in v:
                if isinstance(item, list) and not item:
                    raise ValueError("a token-id prompt must not be an empty list")
                if isinstance(item, int) and item < 0:
                    raise ValueError(f"token ids must be non-negative, got {item}")
                if isinstance(item, list) and any(t < 0 for t in item):
                    raise ValueError("token ids must be non-negative")
        return v

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

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None:
            raise ValueError(f"suffix {_NO_SUFFIX if _online(info) else _NOT_IN_BATCH}")
        return v

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, v: bool | None, info: ValidationInfo) -> bool | None:
        if v and not _online(info):
            raise ValueError(f"stream=true {_NOT_IN_BATCH}")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options(
        cls, v: dict[str, Any] | None, info: ValidationInfo
    ) -> dict[str, Any] | None:
        if v is not None and not _online(info):
            raise ValueError(f"stream_options {_NOT_IN_BATCH}")
        return check_stream_options(v)

    @model_validator(mode="after")
    def _best_of_vs_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(
                f"best_of must be greater than or equal to n (got best_of={self.best_of}, "
                f"n={self.n})"
            )
        return self

    @model_validator(mode="after")
    def _streaming(self) -> CompletionRequest:
        # As OpenAI: stream_options only with stream, and best_of > n cannot be streamed
        # (the candidates are ranked once all are done).
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise ValueError(
                f"best_of > n cannot be streamed (got best_of={self.best_of}, n={self.n}): "
                "the candidates are ranked once all of them are done"
            )
        return self

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    # Derived views the engine uses.
    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def candidates(self) -> int:
        return self.best_of if self.best_of is not None else self.n

    @property
    def prompt_count(self) -> int:
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return 1
        return len(p)

    @property
    def sequences(self) -> int:
        """Sequences this line runs: one per candidate of every prompt."""
        return self.prompt_count * self.candidates


def _online(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("online"))


def _error(message: str, param: str | None, code: str | None = None) -> dict[str, Any]:
    return {"message": message, "type": "invalid_request_error", "param": param, "code": code}


_UNION_TAGS = frozenset({"str", "int", "float", "list[str]", "list[int]", "list[list[int]]"})


def _describe(err: Any) -> tuple[str, str | None]:
    """One pydantic error → (message naming parameter and value, param)."""
    # Union branch names (e.g. "list[int]") are pydantic's, not the client's: drop them.
    loc = [str(p)[:64] for p in err.get("loc", ()) if str(p) not in _UNION_TAGS]
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
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
        if param is None:  # model-level checks (best_of vs n, streaming)
            param = next((p for p in ("stream_options", "best_of") if p in msg), None)
        return f"Invalid '{where if loc else param or 'body'}': {msg}.", param
    return f"Invalid '{where}': {show(value)} is not valid ({err.get('msg', kind)}).", param


def check_completion_body(
    body: object,
    max_sequences: int | None = None,
    *,
    online: bool = False,
    check_schema: bool = False,
) -> tuple[CompletionRequest | None, dict[str, Any] | None]:
    """Validate a batch line's body: (request, None) or (None, OpenAI error object).

    `max_sequences` caps prompts x best_of (or n) per line; None reads it from Settings.
    `online`: the body of a POST /v1/completions, where `stream` and `stream_options` are
    allowed; every other check (and its message) is the batch line's. `check_schema`: a
    response_format's schema is checked against the metaschema too (where bodies come in:
    protocol/endpoints.check_body)."""
    if not isinstance(body, dict):
        return None, _error("The request body must be a JSON object.", None, "invalid_body")
    for key in body:
        if key not in KNOWN_PARAMS:
            return None, _error(f"Unrecognized request argument supplied: {key[:64]}", key[:64])
    try:
        context = {"online": online, "check_schema": check_schema}
        req = CompletionRequest.model_validate(body, context=context)
    except ValidationError as exc:
        errors = exc.errors()
        # Prefer the error of the simplest union branch for prompt (several branches fail).
        message, param = _describe(errors[0])
        first = errors[0]
        if tuple(first.get("loc", ()))[:1] == ("prompt",) and first.get("type") != "missing":
            message = (
                "Invalid 'prompt': expected a string, an array of strings, an array of token "
                f"ids or an array of token-id arrays, non-empty ({_prompt_detail(errors)})."
            )
            param = "prompt"
        return None, _error(message, param)
    return _check_sequences(req, max_sequences)


def _check_sequences(
    req: CompletionRequest, limit: int | None
) -> tuple[CompletionRequest | None, dict[str, Any] | None]:
    if limit is None:
        from batchwright.config import get_settings

        limit = get_settings().max_sequences_per_line
    if req.sequences <= limit:
        return req, None
    what, param = ("best_of", "best_of") if req.best_of is not None else ("n", "n")
    return None, _error(
        f"This line asks for {req.sequences} sequences ({req.prompt_count} prompts x "
        f"{what} {req.candidates}); the limit is {limit} sequences per line "
        "(prompts x best_of). Split the prompts over several lines.",
        param,
        "too_many_sequences",
    )


def _prompt_detail(errors: list[Any]) -> str:
    for err in errors:
        if err.get("type") == "value_error":
            return str((err.get("ctx") or {}).get("error", err.get("msg")))
    return f"got {show(errors[0].get('input'))}"[:200]


# --- response objects -------------------------------------------------------------------


class Logprobs(OpenAIBaseModel):
    text_offset: list[int] | None = None
    token_logprobs: list[float | None] | None = None
    tokens: list[str] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None


class CompletionChoice(OpenAIBaseModel):
    finish_reason: Literal["stop", "length", "content_filter"]
    index: int
    logprobs: Logprobs | None = None
    text: str


class PromptTokensDetails(OpenAIBaseModel):
    # Prompt tokens whose keys and values came from the prefix cache instead of a prefill.
    cached_tokens: int = 0


class CompletionUsage(OpenAIBaseModel):
    completion_tokens: int
    prompt_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class Completion(OpenAIBaseModel):
    id: str
    choices: list[CompletionChoice]
    created: int
    model: str
    object: Literal["text_completion"] = "text_completion"
    system_fingerprint: str | None = None
    usage: CompletionUsage | None = None
