"""Torch-free types crossing the boundary between the worker and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenRequest:
    """One input line as the worker holds it, before the engine sees it.

    `key` is opaque to the engine (the worker uses the request row id). `body` is the
    line's `body` object as the client sent it (it passed the body check once at
    validation); the model's preparer (serving/prepare.py) parses it again against the
    model (vocabulary, context, chat template) into the EngineRequest the engine takes,
    or its 400. The engine never sees the body.
    `group` (the worker: the batch) shares the rows between groups when several wait:
    the group with the fewest running rows is admitted first (engine/scheduling/intake.py).
    `stream`: an online request (engine/scheduling/lane.py) whose choices are sent as they grow,
    one delta per engine step (engine/output/streaming.py). `adapter`: the LoRA adapter of the
    engine's model the request names (its `model`), None for the model itself.
    """

    key: Any
    body: dict[str, Any]
    group: Any = None
    stream: bool = False
    adapter: str | None = None


class Wake:
    """What WAKE is: not a line."""


# A request source may yield WAKE to end the engine's wait for input without a request
# (the worker's engine host does when an online request arrives while it waits for lines).
WAKE = Wake()


@dataclass
class GenResult:
    """The outcome of one GenRequest.

    Success: status_code 200, `completion` is the whole Completion object (id "cmpl-…",
    object, created, model, system_fingerprint, choices, usage).
    Rejected by the model (prompt too long, a parameter out of range, …): status_code
    400 and `error` = {"message", "type", "param", "code"} (no envelope; the worker wraps
    it as {"error": ...}).
    """

    key: Any
    status_code: int
    completion: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    extra: dict[str, Any] = field(default_factory=dict)
    # A finished job (engine/requests/jobs.py): its wire object is built outside the engine
    # (batchwright/serving), which then sets `completion` and lets the job go.
    job: Any = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class ModelRefused(ValueError):
    """The model cannot be served by this engine, known at load (engine/loading/model_support.py).
    The message is one line: the architecture and what is missing."""
