"""The /v1/completions request and response models. Torch-free: the API validates with it.

`check_completion_body` turns a batch line's body into either a `CompletionRequest` or an
OpenAI error object that names the parameter and what is wrong with its value.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from batchwright.protocol.base import OpenAIBaseModel
from batchwright.protocol.sampling import (
    MAX_TOKENS,
    SamplingRequest,
    Strings,
    describe,
    online,
    union_detail,
)

# fail_fast: a list of a million wrong items is one error (protocol/sampling.py says why).
TokenIds = Annotated[list[int], Field(fail_fast=True)]
PromptType = str | Strings | TokenIds | Annotated[list[TokenIds], Field(fail_fast=True)]

# Every create parameter OpenAI documents for /v1/completions, in the order a body's errors
# are reported. `suffix`, `stream` and `stream_options` are known (so they get a precise
# message) but not supported in a batch; the online endpoint takes `stream` and
# `stream_options` (validated with online=True).
KNOWN_PARAMS = (
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "best_of",
    "stop",
    "echo",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "seed",
    "user",
    "suffix",
    "stream",
    "stream_options",
    # An extension: OpenAI takes it on chat only (protocol/response_format.py).
    "response_format",
)
_NO_SUFFIX = "is not supported: the models served here complete text, they do not insert it"


class CompletionRequest(SamplingRequest):
    """A batch line body for /v1/completions, with OpenAI's defaults and ranges."""

    PARAMS = KNOWN_PARAMS
    NOT_IN_BATCH = (
        "is not supported in a batch: /v1/completions lines run to completion server-side"
    )

    prompt: PromptType
    # Above any model's context (a line asking more is a 400 at run time); the bound keeps
    # n x max_tokens, summed over a batch's lines for its quota, inside a bigint.
    max_tokens: int = Field(default=16, ge=0, le=MAX_TOKENS)
    best_of: int | None = Field(default=None, ge=1, le=20)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    suffix: str | None = None

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

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None:
            raise ValueError(f"suffix {_NO_SUFFIX if online(info) else cls.NOT_IN_BATCH}")
        return v

    def _conflict(self) -> str | None:
        if self.best_of is not None and self.best_of < self.n:
            return (
                "best_of: best_of must be greater than or equal to n (got "
                f"best_of={self.best_of}, n={self.n})"
            )
        if (why := super()._conflict()) is not None:
            return why
        # As OpenAI: best_of > n cannot be streamed (the candidates are ranked once all are
        # done).
        if self.stream and self.best_of is not None and self.best_of > self.n:
            return (
                f"best_of: best_of > n cannot be streamed (got best_of={self.best_of}, "
                f"n={self.n}): the candidates are ranked once all of them are done"
            )
        return None

    # Derived views the engine uses.
    @property
    def candidates(self) -> int:
        return self.best_of if self.best_of is not None else self.n

    @property
    def candidates_param(self) -> str:
        return "best_of" if self.best_of is not None else "n"

    @property
    def prompt_count(self) -> int:
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return 1
        return len(p)

    @classmethod
    def _explain(cls, errors: list[Any]) -> tuple[str, str | None]:
        # Prefer the error of the simplest union branch for prompt (several branches fail).
        first = errors[0]
        if tuple(first.get("loc", ()))[:1] == ("prompt",) and first.get("type") != "missing":
            return (
                "Invalid 'prompt': expected a string, an array of strings, an array of token "
                f"ids or an array of token-id arrays, non-empty ({union_detail(errors)}).",
                "prompt",
            )
        return describe(first)


# Validate a batch line's body (CompletionRequest.check): (request, None) or (None, an
# OpenAI error object that names the parameter and what is wrong with its value).
check_completion_body = CompletionRequest.check


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
