"""What travels through the relay: the request (API to worker) and its events (worker to API).

A request is one JSON string in Redis; the exact string identifies it there (LREM), so it
is encoded once, when submitted, and never rewritten. Events are stream entries with one
field, `e`, holding the event's JSON; each says which worker and which attempt sent it, so
the API can ignore a worker that was given up for dead and came back.
"""

from __future__ import annotations

import time
from typing import (
    Annotated,
    Any,
    Literal,
    NotRequired,  # pydantic: not typing's, before 3.12
)

import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter
from typing_extensions import TypedDict


class OnlineRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str  # "cmpl-…": also the Completion's id
    model: str
    project_id: str
    key_id: str | None = None
    # The validated /v1/completions body, as a batch line carries it (stream and
    # stream_options included: the worker sends deltas only for a streamed request).
    body: dict[str, Any]
    created: int  # the Completion's `created`, the same on every chunk
    enqueued_at: float
    # Unix time after which no worker may start it: the API has answered 503 by then.
    deadline: float
    # 0, then 1 when the API resubmits it after its worker died mid-generation.
    attempt: int = 0

    @property
    def streamed(self) -> bool:
        return bool(self.body.get("stream"))

    def encode(self) -> str:
        return orjson.dumps(self.model_dump()).decode()

    @classmethod
    def decode(cls, raw: bytes | str) -> OnlineRequest:
        return cls.model_validate(orjson.loads(raw))

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) > self.deadline


class DeltaLogprobs(TypedDict):
    """Logprobs of one delta's tokens; `text_offset` continues from the text already sent."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChoiceDelta(TypedDict):
    """New text of one choice: the one type from the engine (engine/output/streaming.py
    builds them, a plain dict each: no model on the engine's thread) through the worker and
    Redis to the API (validated as part of a Delta). `index` = prompt_index * n + j.
    `text` is safe to show: no stop sequence, no half UTF-8 character. `token_ids`: the
    generated tokens this text completes (empty for the echoed prompt). Exactly one delta
    per choice carries a `finish_reason`. The engine sends every key."""

    index: int
    text: str
    token_ids: NotRequired[list[int]]
    logprobs: NotRequired[DeltaLogprobs | None]
    finish_reason: NotRequired[Literal["stop", "length"] | None]


class _Event(BaseModel):
    worker: str
    attempt: int = 0


class Started(_Event):
    """A worker took the request and its engine has it; the queue deadline no longer runs."""

    type: Literal["started"] = "started"
    system_fingerprint: str | None = None
    # Prompt tokens of the request (all prompts), for the usage of one that never finishes.
    prompt_tokens: int | None = None


class Delta(_Event):
    """At most one per engine step per request; the choices that gained text this step."""

    type: Literal["delta"] = "delta"
    choices: list[ChoiceDelta]


class Tick(_Event):
    """The worker's engine still steps for the request: sent when nothing else went to it
    for a while (a request waiting for rows, a non-streamed one), so the API can tell a
    stuck engine from a slow request (its idle timeout)."""

    type: Literal["tick"] = "tick"


class Done(_Event):
    """The full Completion object: what a batch line's body would be, usage included."""

    type: Literal["done"] = "done"
    completion: dict[str, Any]


class Failed(_Event):
    """The request ended without a Completion. `status` is the HTTP status it means (400
    for a request the model rejects, 503 for a worker that died, 500 for a bug) and `error`
    is OpenAI's error object {message, type, param, code}."""

    type: Literal["error"] = "error"
    status: int
    error: dict[str, Any]


Event = Annotated[Started | Delta | Tick | Done | Failed, Field(discriminator="type")]
_EVENT: TypeAdapter[Event] = TypeAdapter(Event)
FIELD = b"e"
# Code of the Failed event the reaper writes for a request whose worker died after it
# started (the API resubmits it once if the client has seen nothing yet).
WORKER_LOST = "worker_lost"
# Code of the Failed event the API makes for a started request whose worker sent nothing
# within the idle timeout (relay/api_side.py).
STALLED = "engine_stalled"


def encode_event(event: Started | Delta | Tick | Done | Failed) -> bytes:
    # An embeddings Done carries its vectors as float32 arrays (protocol/embeddings.py).
    return orjson.dumps(event.model_dump(exclude_none=False), option=orjson.OPT_SERIALIZE_NUMPY)


def decode_event(raw: bytes | str) -> Event:
    return _EVENT.validate_json(raw)
