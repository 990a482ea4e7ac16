"""Thin Celery tasks: ids in, re-fetch from the database, call the control work or the
runner. The Celery worker imports this module (celery_app's `imports`): it composes the
worker process, so it installs the webhook outbox's hook here."""

from __future__ import annotations

from typing import Any

from celery.signals import worker_shutting_down
from sqlalchemy.exc import DBAPIError, OperationalError

from batchwright import control
from batchwright.controlplane.celery_app import celery_app
from batchwright.files import purge
from batchwright.webhooks import delivery, outbox
from batchwright.worker.generation import hosts, runner

outbox.install()

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
    control.validate_batch(batch_id)


@celery_app.task(name="batchwright.process", **RETRY)
def process(model: str) -> None:
    runner.process(model, on_cancel=control.finalize_batch, host=hosts.get(model))


@celery_app.task(name="batchwright.finalize_batch", **RETRY)
def finalize_batch(batch_id: str) -> None:
    control.finalize_batch(batch_id)


@celery_app.task(name="batchwright.sweep", **RETRY)
def sweep() -> None:
    control.sweep()


@celery_app.task(name="batchwright.purge_files", **RETRY)
def purge_files() -> None:
    if purge.purge()[2]:
        purge_files.delay()


# Short waits are scheduled here; long ones (and lost messages) are left to the sweeper.
SHORT_RETRY_SECONDS = 300


@celery_app.task(name="batchwright.deliver_webhook", **RETRY)
def deliver_webhook(delivery_id: str) -> None:
    retry_in = delivery.deliver(delivery_id)
    if retry_in is not None and retry_in <= SHORT_RETRY_SECONDS:
        deliver_webhook.apply_async((delivery_id,), countdown=retry_in)
