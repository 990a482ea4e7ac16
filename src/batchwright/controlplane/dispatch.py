"""How work is announced: Celery messages in the service, an in-process queue when embedded.

Messages carry ids only and are sent after the database commit (db.session.after_commit),
so a worker never wakes to a row it cannot see yet. Generation work (`process`, one model)
goes to that model's queue; everything else (validate, finalize, sweep, deliveries) to the
control queue, which any worker serves (routing.py says which queues a worker takes).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from sqlalchemy.orm import Session

from batchwright.config import Settings, get_settings
from batchwright.db.session import after_commit

VALIDATE = "batchwright.validate_batch"
PROCESS = "batchwright.process"
FINALIZE = "batchwright.finalize_batch"
SWEEP = "batchwright.sweep"


def control_queue(settings: Settings | None = None) -> str:
    return (settings or get_settings()).queue


def model_queue(model: str, settings: Settings | None = None) -> str:
    return f"{control_queue(settings)}.model.{model}"


def queue_for(name: str, args: Sequence[Any], settings: Settings | None = None) -> str:
    if name == PROCESS and args:
        return model_queue(str(args[0]), settings)
    return control_queue(settings)


class Dispatcher(Protocol):
    def send(self, name: str, *args: Any) -> None: ...


class CeleryDispatcher:
    def send(self, name: str, *args: Any) -> None:
        from batchwright.controlplane.celery_app import celery_app

        celery_app.send_task(name, args=list(args), queue=queue_for(name, args))


class InlineDispatcher:
    """Embedded default: tasks queue up in memory and the caller drains them in-process."""

    def __init__(self) -> None:
        self.queue: deque[tuple[str, tuple[Any, ...]]] = deque()

    def send(self, name: str, *args: Any) -> None:
        if (name, args) not in self.queue:
            self.queue.append((name, args))


_dispatcher: Dispatcher | None = None


def set_dispatcher(dispatcher: Dispatcher) -> None:
    global _dispatcher
    _dispatcher = dispatcher


def get_dispatcher() -> Dispatcher:
    global _dispatcher
    if _dispatcher is None:
        _dispatcher = CeleryDispatcher()
    return _dispatcher


def enqueue(session: Session, name: str, *args: Any) -> None:
    after_commit(session, lambda: get_dispatcher().send(name, *args))
