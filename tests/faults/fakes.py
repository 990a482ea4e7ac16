"""A stand-in engine for in-process runner tests: only run() matters to the worker.

It runs in an engine host (worker/generation/engine_host.py) as the model does: its source
is the host's, which yields WAKE when a lease comes and when its lines end, and ends when
the host stops."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from batchwright.engine.requests.types import WAKE


class FakeEngine:
    """Stands in for the model: a completion per request, a little time per request."""

    def __init__(self, delay: float = 0.01) -> None:
        self.delay = delay

    def run(self, requests: Iterable[Any], cancelled: Any = None) -> Iterator[Any]:
        from batchwright.engine.requests.types import GenResult

        for req in requests:
            if req is WAKE:
                continue
            time.sleep(self.delay)
            completion = {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": "demo",
                "system_fingerprint": "fake",
                "choices": [
                    {"index": 0, "text": "ok", "logprobs": None, "finish_reason": "length"}
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            }
            yield GenResult(
                key=req.key,
                status_code=200,
                completion=completion,
                prompt_tokens=3,
                completion_tokens=2,
            )


def lease_lines(lines: Iterator[Any]) -> list[Any]:
    """All the lines of the next lease that has any (its end: the host's WAKE); none once
    the host stops."""
    held: list[Any] = []
    for req in lines:
        if req is not WAKE:
            held.append(req)
        elif held:
            break
    return held


def provider(engine: Any) -> Callable[[Any], Any]:
    """An engine_provider handing out this engine (duck-typed: run() is all it needs)."""
    return lambda _spec: engine
