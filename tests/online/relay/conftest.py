"""The relay against the real Redis (BW_TEST_REDIS), under a queue name of its own; the
worker side is the real WorkerRelay driven by the test (no engine behind it)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
import redis

from batchwright.relay.messages import OnlineRequest
from batchwright.relay.worker_side import WorkerRelay
from tests.conftest import REDIS, _unavailable
from tests.helpers import wait_until

T = TypeVar("T")


class Relays:
    def __init__(self, client: redis.Redis, queue: str) -> None:
        self.redis = client
        self.queue = queue

    def worker(self, name: str, models: list[str], ttl: float = 30.0) -> WorkerRelay:
        relay = WorkerRelay(self.redis, self.queue, name, models, ttl_seconds=ttl)
        relay.announce()
        return relay

    def request(self, model: str = "m", deadline_in: float = 60.0, **body: Any) -> OnlineRequest:
        now = time.time()
        return OnlineRequest(
            id=f"cmpl-{uuid.uuid4().hex}",
            model=model,
            project_id="proj_test",
            key_id="key_test",
            body={"model": model, "prompt": "hi", **body},
            created=int(now),
            enqueued_at=now,
            deadline=now + deadline_in,
        )

    def kill(self, worker: WorkerRelay) -> None:
        """What SIGKILL leaves once the liveness TTL ran out: the key is gone, nothing else."""
        self.redis.delete(worker.keys.worker(worker.worker_id))


@pytest.fixture
def relays() -> Iterator[Relays]:
    client = redis.Redis.from_url(REDIS, socket_timeout=10)
    try:
        client.ping()
    except Exception as exc:
        _unavailable("Redis", exc)
    queue = f"bw-relay-{uuid.uuid4().hex[:8]}"
    yield Relays(client, queue)
    keys = list(client.scan_iter(match=f"{queue}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def run(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(factory())


def wait_for(condition: Callable[[], Any], timeout: float = 30, what: str = "condition") -> Any:
    return wait_until(condition, what, timeout, every=0.02)
