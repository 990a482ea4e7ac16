"""The /v1/chat/completions request and response models. Torch-free: the API validates with it.

A chat line is a completion of the prompt its model's chat template renders from
`messages` (engine/requests/chat.py); `check_chat_body` turns a body into a `ChatCompletionRequest`
or an OpenAI error object naming the parameter, as `check_completion_body` does.
"""

from __future__ import annotations

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
from batchwright.protocol.completions import (
    _INT64,
    MAX_TOKENS,
    CompletionUsage,
    Strings,
    _check_sequences,
    _describe,
    _error,
    _online,
    check_logit_bias,
    check_stop,
    check_stream_options,
    logit_bias_numbers,
    show,
)
from batchwright.protocol.response_format import ResponseFormat

# OpenAI's parameters for features batchwright does not have: a 400 naming the parameter.
UNSUPPORTED_PARAMS = {
    "tools": "tool calling",
    "tool_choice": "tool calling",
    "parallel_tool_calls": "tool calling",
    "functions": "function calling",
    "function_call": "function calling",
    "audio": "audio output",
    "modalities": "output modalities other than text",
    "prediction": "predicted outputs",
    "web_search_options": "web search",
    "reasoning_effort": "reasoning models",
}
# Accepted and ignored: OpenAI keeps them for its dashboards and routing.
IGNORED_PARAMS = frozenset(
    {"metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "user"}
)
KNOWN_PARAMS = frozenset(
    {
        "model",
        "messages",
        "max_completion_tokens",
        "max_tokens",
        "n",
        "temperature",
        "top_p",
        "stop",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "response_format",
        "stream",
        "stream_options",
        *IGNORED_PARAMS,
    }
)
ROLES = ("system", "developer", "user", "assistant")
_CHAT_NOT_IN_BATCH = "is not supported in a batch: chat lines run to completion server-side"
MAX_TOP_LOGPROBS = 20


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[ContentPart], Field(fail_fast=True)]
    name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        # Text parts are joined by newlines, as vLLM renders them for string templates.
        return "\n".join(p.text for p in self.content)


class ChatCompletionRequest(BaseModel):
    """A /v1/chat/completions body, with OpenAI's defaults and ranges."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    # fail_fast: a million bad messages are one error, not a million (protocol/completions).
    messages: list[ChatMessageIn] = Field(min_length=1, fail_fast=True)
    max_completion_tokens: int | None = Field(default=None, ge=0, le=MAX_TOKENS)
    max_tokens: int | None = Field(default=None, ge=0, le=MAX_TOKENS)
    n: int = Field(default=1, ge=1, le=128)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    stop: str | Strings | None = None
    seed: int | None = Field(default=None, ge=-_INT64, le=_INT64 - 1)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

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
        if v and not _online(info):
            raise ValueError(f"stream=true {_CHAT_NOT_IN_BATCH}")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options(
        cls, v: dict[str, Any] | None, info: ValidationInfo
    ) -> dict[str, Any] | None:
        if v is not None and not _online(info):
            raise ValueError(f"stream_options {_CHAT_NOT_IN_BATCH}")
        return check_stream_options(v)

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: stream_options is only allowed when stream is true")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: 'logprobs' must be true when 'top_logprobs' is set")
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise ValueError(
                "max_tokens: set 'max_completion_tokens' or its older name 'max_tokens', not "
                f"both with different values (got {self.max_completion_tokens} and "
                f"{self.max_tokens})"
            )
        return self

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    # Views the engine and the validation share with completion lines.
    @property
    def max_new_tokens(self) -> int | None:
        """The most tokens a choice may generate; None: up to the context length."""
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def top_k(self) -> int | None:
        """Top logprobs wanted per token (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def prompt_count(self) -> int:
        return 1

    @property
    def candidates(self) -> int:
        return self.n

    @property
    def best_of(self) -> None:
        return None

    @property
    def sequences(self) -> int:
        return self.n


def _unsupported(body: dict[str, Any]) -> dict[str, Any] | None:
    """The first parameter or message feature batchwright does not have, as a 400."""
    for key, feature in UNSUPPORTED_PARAMS.items():
        if key in body:
            return _error(
                f"Unsupported parameter: '{key}' is not supported by batchwright ({feature}); "
                "chat lines generate text.",
                key,
                "unsupported_parameter",
            )
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            continue
        role = msg.get("role")
        if isinstance(role, str) and role not in ROLES:
            return _error(
                f"Unsupported value: 'messages[{i}].role' {show(role)} is not supported; "
                f"roles are {', '.join(ROLES)}.",
                f"messages[{i}].role",
                "unsupported_value",
            )
        for key in ("tool_calls", "function_call", "audio", "refusal", "tool_call_id"):
            if key in msg:
                return _error(
                    f"Unsupported parameter: 'messages[{i}].{key}' is not supported by "
                    "batchwright; messages carry text content only.",
                    f"messages[{i}].{key}",
                    "unsupported_parameter",
                )
        content = msg.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                return _error(
                    f"Unsupported value: 'messages[{i}].content[{j}].type' {show(kind)} is not "
                    "supported; batchwright takes content parts of type 'text' only.",
                    f"messages[{i}].content[{j}].type",
                    "unsupported_value",
                )
    return None


def check_chat_body(
    body: object,
    max_sequences: int | None = None,
    *,
    online: bool = False,
    check_schema: bool = False,
) -> tuple[ChatCompletionRequest | None, dict[str, Any] | None]:
    """Validate a chat line's body: (request, None) or (None, OpenAI error object).
    `online`: the body of a POST /v1/chat/completions, where `stream` and `stream_options`
    are allowed; `check_schema`: a response_format's schema is checked against the
    metaschema too (where bodies come in: protocol/endpoints.check_body)."""
    if not isinstance(body, dict):
        return None, _error("The request body must be a JSON object.", None, "invalid_body")
    for key in body:
        if key not in KNOWN_PARAMS and key not in UNSUPPORTED_PARAMS:
            return None, _error(f"Unrecognized request argument supplied: {key[:64]}", key[:64])
    if (err := _unsupported(body)) is not None:
        return None, err
    try:
        context = {"online": online, "check_schema": check_schema}
        req = ChatCompletionRequest.model_validate(body, context=context)
    except ValidationError as exc:
        first = exc.errors()[0]
        message, param = _describe(first)
        if param is None and first.get("type") == "value_error":
            # Checks across parameters (_consistent) say which one first: "name: why".
            param, _, why = str((first.get("ctx") or {}).get("error", "")).partition(": ")
            message = f"Invalid '{param}': {why}."
        return None, _error(message, param)
    _, err = _check_sequences(req, max_sequences)  # type: ignore[arg-type]
    return (req, None) if err is None else (None, err)


# --- response objects -------------------------------------------------------------------


def chat_id(completion_id: str) -> str:
    """A chat completion's id for a completion id ("cmpl-x" -> "chatcmpl-x"): the engine,
    the worker and the streamed chunks name a chat request alike."""
    return "chatcmpl-" + completion_id.removeprefix("cmpl-")


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(OpenAIBaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class ChatMessage(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None


class ChatChoice(OpenAIBaseModel):
    finish_reason: Literal["stop", "length", "content_filter"]
    index: int
    logprobs: ChoiceLogprobs | None = None
    message: ChatMessage


class ChatCompletion(OpenAIBaseModel):
    id: str
    choices: list[ChatChoice]
    created: int
    model: str
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None
    usage: CompletionUsage | None = None
