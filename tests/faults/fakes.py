"""A stand-in engine for in-process runner tests: only run() matters to the worker."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any


class FakeEngine:
    """Stands in for the model: a completion per request, a little time per request."""

    def __init__(self, delay: float = 0.01) -> None:
        self.delay = delay

    def run(self, requests: Iterable[Any], cancelled: Any = None) -> Iterator[Any]:
        from batchwright.engine.requests.types import GenResult

        for req in requests:
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


def provider(engine: Any) -> Callable[[Any], Any]:
    """An engine_provider handing out this engine (duck-typed: run() is all it needs)."""
    return lambda _spec: engine
