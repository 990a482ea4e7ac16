"""Wire models for Files and Batches, as the official openai SDK models them."""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from batchwright.protocol.base import OpenAIBaseModel

T = TypeVar("T")


class FileObject(OpenAIBaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileDeleted(OpenAIBaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class ListObject(OpenAIBaseModel, Generic[T]):
    object: Literal["list"] = "list"
    data: list[T]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class RequestCounts(OpenAIBaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchErrorItem(OpenAIBaseModel):
    code: str | None = None
    line: int | None = None
    message: str | None = None
    param: str | None = None


class BatchErrors(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorItem] = Field(default_factory=list)


class BatchUsage(OpenAIBaseModel):
    input_tokens: int = 0
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens: int = 0
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int = 0


class BatchObject(OpenAIBaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None = None
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None
    usage: BatchUsage


class CreateBatch(BaseModel):
    """POST /v1/batches body. Strict: a typo in a field name is a 400, not ignored."""

    model_config = {"extra": "forbid"}

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None

    @field_validator("input_file_id", "endpoint", "completion_window")
    @classmethod
    def _storable_text(cls, v: str, info: ValidationInfo) -> str:
        if not storable(v):
            raise ValueError(f"'{info.field_name}' must not contain {UNSTORABLE}")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return v
        if len(v) > 16:
            raise ValueError("metadata may hold at most 16 key-value pairs")
        for key, value in v.items():
            if not (storable(key) and storable(value)):
                raise ValueError(f"metadata keys and values must not contain {UNSTORABLE}")
            if len(key) > 64:
                raise ValueError(f"metadata key {key[:20]!r}... is longer than 64 characters")
            if len(value) > 512:
                raise ValueError(f"metadata value for {key!r} is longer than 512 characters")
        return v


UNSTORABLE = "NUL characters or lone UTF-16 surrogates"


def storable(text: str) -> bool:
    """Whether Postgres text can hold `text`: no NUL, and valid UTF-8 (JSON's "\\ud800" is
    valid JSON but a lone surrogate, which no UTF-8 encoding has). Refused as the client's
    mistake, not a 500 or a 503."""
    if "\x00" in text:
        return False
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class Model(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "batchwright"
    # Extension: workers with a live heartbeat serving this model (0: batches wait).
    live_workers: int | None = None
    # Extension: why no worker serves it (a worker refused it at load, in one line);
    # batches for it fail at validation with code `model_unavailable` while this is set.
    unavailable: str | None = None
    # A LoRA adapter's base model (as vLLM lists adapters); None for a whole model.
    parent: str | None = None
