"""The /v1/chat/completions request and response models. Torch-free: the API validates with it.

A chat line is a completion of the prompt its model's chat template renders from
`messages` (serving/chat_prompt.py); `check_chat_body` turns a body into a `ChatCompletionRequest`
or an OpenAI error object naming the parameter, as `check_completion_body` does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from batchwright.protocol.base import OpenAIBaseModel
from batchwright.protocol.completions import CompletionUsage
from batchwright.protocol.sampling import MAX_TOKENS, SamplingRequest, request_error, show

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
IGNORED_PARAMS = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
)
# In the order a body's errors are reported.
KNOWN_PARAMS = (
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
    *IGNORED_PARAMS,
    "stream",
    "stream_options",
)
ROLES = ("system", "developer", "user", "assistant")
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


class ChatCompletionRequest(SamplingRequest):
    """A /v1/chat/completions body, with OpenAI's defaults and ranges."""

    PARAMS = KNOWN_PARAMS
    UNSUPPORTED = UNSUPPORTED_PARAMS
    NOT_IN_BATCH = "is not supported in a batch: chat lines run to completion server-side"

    # fail_fast: a million bad messages are one error, not a million (protocol/sampling).
    messages: list[ChatMessageIn] = Field(min_length=1, fail_fast=True)
    max_completion_tokens: int | None = Field(default=None, ge=0, le=MAX_TOKENS)
    max_tokens: int | None = Field(default=None, ge=0, le=MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def _conflict(self) -> str | None:
        if (why := super()._conflict()) is not None:
            return why
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs: 'logprobs' must be true when 'top_logprobs' is set"
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            return (
                "max_tokens: set 'max_completion_tokens' or its older name 'max_tokens', not "
                f"both with different values (got {self.max_completion_tokens} and "
                f"{self.max_tokens})"
            )
        return None

    @classmethod
    def _refuse(cls, body: dict[str, Any]) -> dict[str, Any] | None:
        return super()._refuse(body) or _unsupported(body)

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
    def top_k(self) -> int | None:
        """Top logprobs wanted per token (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def best_of(self) -> None:
        return None


def _unsupported(body: dict[str, Any]) -> dict[str, Any] | None:
    """The first parameter or message feature batchwright does not have, as a 400."""
    for key, feature in UNSUPPORTED_PARAMS.items():
        if key in body:
            return request_error(
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
            return request_error(
                f"Unsupported value: 'messages[{i}].role' {show(role)} is not supported; "
                f"roles are {', '.join(ROLES)}.",
                f"messages[{i}].role",
                "unsupported_value",
            )
        for key in ("tool_calls", "function_call", "audio", "refusal", "tool_call_id"):
            if key in msg:
                return request_error(
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
                return request_error(
                    f"Unsupported value: 'messages[{i}].content[{j}].type' {show(kind)} is not "
                    "supported; batchwright takes content parts of type 'text' only.",
                    f"messages[{i}].content[{j}].type",
                    "unsupported_value",
                )
    return None


# Validate a chat line's body (ChatCompletionRequest.check): (request, None) or (None, an
# OpenAI error object naming the parameter). `online`: the body of a POST
# /v1/chat/completions, where `stream` and `stream_options` are allowed.
check_chat_body = ChatCompletionRequest.check


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
