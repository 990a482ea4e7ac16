"""One online request's account: what it was, how it ended, what it cost. At the end it
becomes a usage row, metrics, and the settlement of its rate-limit charge."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from batchwright.db.base import new_id
from batchwright.errors import APIError
from batchwright.online import metrics
from batchwright.online.inflight import Slot

# A client that left before the end (nginx's code for it).
CLIENT_CLOSED = 499


@dataclass
class Call:
    project_id: str
    key_id: str
    id: str = field(default_factory=lambda: new_id("cmpl-", 8))
    # A name of the registry, set once the model checked out: metrics label with it, so a
    # client's string never becomes a label. `requested`: what the body named (usage row).
    model: str = ""
    requested: str = ""
    stream: bool = False
    arrived: float = field(default_factory=time.time)
    t0: float = field(default_factory=time.monotonic)
    status: int = 200
    error_code: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: float | None = None
    finish_reasons: list[str] | None = None
    disconnected: bool = False
    charged_tokens: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    slot: Slot | None = None  # its place among the process's requests in flight
    finished: bool = False  # counted, recorded, settled (once)
    _last_chunk: float | None = None

    def failed(self, exc: APIError) -> None:
        self.status, self.error_code = exc.status_code, exc.code

    def failed_with(self, status: int, error: dict[str, Any]) -> None:
        self.status, self.error_code = status, error.get("code")

    def gone(self) -> None:
        self.status, self.disconnected = CLIENT_CLOSED, True
        metrics.DISCONNECTS.labels(self.model).inc()

    def completed(self, completion: dict[str, Any]) -> None:
        usage = completion.get("usage") or {}
        self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        self.completion_tokens = int(usage.get("completion_tokens") or 0)
        self.finish_reasons = [str(c.get("finish_reason")) for c in completion.get("choices", [])]

    def chunk_sent(self, tokens: int) -> None:
        now = time.monotonic()
        if self.ttft is None:
            self.ttft = now - self.t0
            metrics.TIME_TO_FIRST_TOKEN.labels(self.model).observe(self.ttft)
        elif tokens and self._last_chunk is not None:
            metrics.INTER_TOKEN_LATENCY.labels(self.model).observe(
                (now - self._last_chunk) / tokens
            )
        if tokens:
            self._last_chunk = now

    @property
    def used_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def row(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "project_id": self.project_id,
            "key_id": self.key_id,
            "model": (self.model or self.requested)[:200],
            "created_at": self.arrived,
            "stream": self.stream,
            "status": self.status,
            "error_code": (self.error_code or None) and str(self.error_code)[:64],
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "time_to_first_token": self.ttft,
            "duration": time.monotonic() - self.t0,
            "finish_reasons": self.finish_reasons,
            "disconnected": self.disconnected,
        }

    def count(self) -> None:
        metrics.REQUESTS.labels(self.model, str(self.status), str(self.stream).lower()).inc()
        if self.prompt_tokens:
            metrics.TOKENS.labels(self.model, "prompt").inc(self.prompt_tokens)
        if self.completion_tokens:
            metrics.TOKENS.labels(self.model, "completion").inc(self.completion_tokens)
