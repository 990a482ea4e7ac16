"""Wake-ups: one `process` message per live worker of the model, on the model's queue."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.shared.conftest import Service


@pytest.fixture
def recorder(service: Service, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """This process pointed at the service's database; messages recorded, not sent."""
    from batchwright.config import get_settings
    from batchwright.controlplane import dispatch
    from batchwright.controlplane.dispatch import queue_for
    from batchwright.db.session import get_engine, get_sessionmaker

    def reset() -> None:
        get_settings.cache_clear()
        get_sessionmaker.cache_clear()
        get_engine.cache_clear()

    for key, value in service.env.items():
        if key.startswith("BATCHWRIGHT_"):
            monkeypatch.setenv(key, value)
    reset()
    sent: list[Any] = []

    class Recorder:
        def send(self, name: str, *args: Any) -> None:
            sent.append((queue_for(name, args), name, *args))

    monkeypatch.setattr(dispatch, "_dispatcher", Recorder())
    yield sent
    service.sql("DELETE FROM worker_heartbeats")
    get_engine().dispose()
    monkeypatch.undo()
    reset()


def beat(svc: Service, wid: str, models: str, *, age: float = 0.0, in_flight: int = 0) -> None:
    now = time.time()
    svc.sql(
        "INSERT INTO worker_heartbeats (id, host, pid, models, loaded, control, rows_in_flight,"
        " tokens_per_second, lines_completed, started_at, last_seen)"
        " VALUES (%s, 'h', 1, %s, '', true, %s, 0, 0, %s, %s)",
        wid,
        models,
        in_flight,
        now - age,
        now - age,
    )


def test_a_batch_wakes_every_live_worker_of_its_model(service: Service, recorder: Any) -> None:
    from batchwright.controlplane import dispatch, routing
    from batchwright.controlplane.dispatch import PROCESS
    from batchwright.db.session import session_scope

    queue = service.env["BATCHWRIGHT_QUEUE"]
    beat(service, "w1", "demo")
    beat(service, "w2", "demo,demo-b", in_flight=12)
    beat(service, "w3", "demo", age=60)  # stopped beating: not woken
    beat(service, "w4", "")  # control-only

    with session_scope() as session:
        assert routing.wake(session, "demo") == 2
    assert recorder == [(f"{queue}.model.demo", PROCESS, "demo")] * 2
    recorder.clear()
    with session_scope() as session:
        assert routing.wake(session, "demo", idle_only=True) == 1  # w2 is busy
        assert routing.wake(session, "demo-b") == 1
    assert recorder[-1] == (f"{queue}.model.demo-b", PROCESS, "demo-b")
    # Control work goes to the control queue.
    assert dispatch.queue_for("batchwright.validate_batch", ["batch_x"]) == queue
