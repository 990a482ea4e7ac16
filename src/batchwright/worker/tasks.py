"""Thin Celery tasks: ids in, re-fetch from the database, call the runner."""

from __future__ import annotations

from typing import Any

from celery.signals import worker_shutting_down
from sqlalchemy.exc import DBAPIError, OperationalError

from batchwright.worker import runner
from batchwright.worker.celery_app import celery_app

# A database that drops connections or restarts is retried with backoff.
TRANSIENT = (OperationalError, DBAPIError)
RETRY = {
    "autoretry_for": TRANSIENT,
    "retry_backoff": 1,
    "retry_backoff_max": 30,
    "max_retries": 8,
}


@worker_shutting_down.connect
def _stop_claiming(**_: Any) -> None:
    runner.SHUTDOWN.set()


@celery_app.task(name="batchwright.validate_batch", **RETRY)
def validate_batch(batch_id: str) -> None:
    runner.validate_batch(batch_id)


@celery_app.task(name="batchwright.process", **RETRY)
def process(model: str) -> None:
    runner.process(model)


@celery_app.task(name="batchwright.finalize_batch", **RETRY)
def finalize_batch(batch_id: str) -> None:
    runner.finalize_batch(batch_id)


@celery_app.task(name="batchwright.sweep", **RETRY)
def sweep() -> None:
    runner.sweep()
