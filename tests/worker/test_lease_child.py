"""The lease child sends a batch's finalize itself: in the service (a Celery dispatcher in
the generation process) the message goes from the child to the broker's control queue,
not through the generation process; where the generation process's dispatcher is
in-process (the embedded run, in-process tests) it comes over the pipe to that one."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from tests.faults.fakes import FakeEngine, provider
from tests.worker.conftest import add_batch


@pytest.fixture
def broker(database: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """This test's Celery queue on the real Redis (the child reads it from the env)."""
    import redis

    from batchwright.config import get_settings

    queue = f"bw-test-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("BATCHWRIGHT_BROKER_URL", redis_url)
    monkeypatch.setenv("BATCHWRIGHT_QUEUE", queue)
    get_settings.cache_clear()
    client = redis.Redis.from_url(redis_url)
    yield client, queue
    client.delete(queue)
    client.close()


def _tasks(client: Any, queue: str) -> list[tuple[str, list[Any]]]:
    """The (task, args) of the messages waiting on `queue` (kombu's Redis transport)."""
    out = []
    for raw in client.lrange(queue, 0, -1):
        message = orjson.loads(raw)
        args = orjson.loads(base64.b64decode(message["body"]))[0]
        out.append((message["headers"]["task"], args))
    return out


def _process_all(batch_id: str) -> int:
    from batchwright.db.models import BatchRequest
    from batchwright.db.session import session_scope
    from batchwright.worker.generation import runner

    landed = runner.process("demo", engine_provider=provider(FakeEngine(delay=0.0)))
    with session_scope() as session:
        states = {r.state for r in session.query(BatchRequest).filter_by(batch_id=batch_id).all()}
    assert states == {"succeeded"}
    return landed


def test_the_child_sends_the_finalize_to_the_broker_itself(
    broker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchwright.controlplane import dispatch

    client, queue = broker

    class Watched(dispatch.CeleryDispatcher):
        """The generation process's dispatcher, a Celery one that only records."""

        def __init__(self) -> None:
            self.sent: list[tuple[str, tuple[Any, ...]]] = []

        def send(self, name: str, *args: Any) -> None:
            self.sent.append((name, args))

    watched = Watched()
    monkeypatch.setattr(dispatch, "_dispatcher", watched)
    batch_id = add_batch(5)
    assert _process_all(batch_id) == 5
    assert (dispatch.FINALIZE, [batch_id]) in _tasks(client, queue)
    assert all(name != dispatch.FINALIZE for name, _ in watched.sent)


def test_an_in_process_dispatcher_gets_the_finalize_over_the_pipe(broker: Any) -> None:
    from batchwright.controlplane import dispatch

    client, queue = broker
    inline = dispatch.get_dispatcher()  # the conftest's in-memory one
    assert isinstance(inline, dispatch.InlineDispatcher)
    batch_id = add_batch(5)
    assert _process_all(batch_id) == 5
    assert (dispatch.FINALIZE, (batch_id,)) in inline.queue
    assert _tasks(client, queue) == []
