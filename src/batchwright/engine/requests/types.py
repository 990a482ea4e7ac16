"""Torch-free types crossing the boundary between the worker and the engine.

A line comes in as a GenRequest (its wire body); the engine's preparer
(requests/prepare.py) turns it, off the engine's thread, into an EngineRequest (prompt
ids and validated sampling parameters) or a GenResult(400); the engine takes those, and
hands out a GenResult per request.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenRequest:
    """One input line, as its wire body.

    `key` is opaque to the engine (the worker uses the request row id). `body` is the
    line's `body` object as the client sent it. `group` (the worker: the batch) shares the
    rows between groups when several wait: the group with the fewest running rows is
    admitted first (scheduling/intake.py). `stream`: an online request
    (scheduling/lane.py) whose choices are sent as they grow, one delta per engine step
    (output/streaming.py).
    """

    key: Any
    body: dict[str, Any]
    group: Any = None
    stream: bool = False


@dataclass
class Sampling:
    """A request's generation parameters, validated: the engine checks none of them again.
    `candidates` is best_of (or n); `logit_bias` ids lie inside the vocabulary."""

    max_tokens: int
    n: int
    candidates: int
    temperature: float
    top_p: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: dict[int, float]
    logprobs: int | None  # top-k wanted per position; None: no logprobs
    echo: bool
    stop_list: list[str]
    seed: int | None


@dataclass(eq=False)
class EngineRequest:
    """What the engine takes: a line validated and tokenized (requests/prepare.py).

    `prompts` are token ids (a completion's prompts, or a chat line's rendered messages),
    `echo_texts` their text as an echo returns it, `endpoint` the path whose object the
    result becomes (built outside the engine), `grammar` the compile of its
    response_format (a future; None without one). `key`, `group` and `stream` are the
    GenRequest's.
    """

    key: Any
    prompts: list[list[int]]
    echo_texts: list[str]
    sampling: Sampling
    endpoint: str
    group: Any = None
    stream: bool = False
    response_format: Any = None  # protocol's ResponseFormat, or None for text
    grammar: Future[Any] | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


class Wake:
    """A request source may yield WAKE to end the engine's wait for input without a
    request (the worker's engine host does when an online request arrives while it waits
    for lines)."""


WAKE = Wake()


@dataclass
class GenResult:
    """The outcome of one request.

    Success: status_code 200, and once serving/ rendered it `completion` is the whole
    Completion object (id "cmpl-…", object, created, model, system_fingerprint, choices,
    usage); the engine hands it out with `job` instead.
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
    # The finished job (engine/requests/jobs.py) a wire object is built from, outside the
    # engine (batchwright/serving); None once built, and for errors.
    job: Any = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
