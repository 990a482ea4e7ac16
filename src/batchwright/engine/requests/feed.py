"""The lane's feed: what the engine asks of the source of the requests that go ahead of
batch lines, the online requests (scheduling/lane.py). `Engine.run(requests, online=feed)`;
the worker's relay pump (worker/generation/pump.py) is one."""

from __future__ import annotations

from typing import Any, Protocol

from batchwright.engine.requests.request import EngineRequest
from batchwright.engine.requests.types import GenResult
from batchwright.relay.messages import ChoiceDelta

# One choice's delta, as the relay carries it to the API: output/streaming.py builds them.
Delta = ChoiceDelta


class LaneFeed(Protocol):
    def take(self) -> list[EngineRequest | GenResult]:
        """Online requests that arrived since the last call (never waits), prepared
        (serving/prepare.py), or refused by the preparer."""
        ...

    def started(self, key: Any, prompt_tokens: int) -> None:
        """The engine has the request (it passed the model's checks)."""
        ...

    def emit(self, key: Any, deltas: list[Delta]) -> None:
        """What the choices of a streamed request gained in one step."""
        ...

    def preempted(self, lines: int, rows: int) -> None:
        """Batch lines (and their rows) that gave their rows to online requests."""
        ...

    def rows(self, online: int) -> None:
        """Rows online requests hold after a step."""
        ...
