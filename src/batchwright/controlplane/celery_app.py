"""The Celery application. Importable by the API (to send by name): no torch here."""

from __future__ import annotations

from celery import Celery

from batchwright.config import get_settings

settings = get_settings()

celery_app = Celery("batchwright", broker=settings.broker_url or "redis://127.0.0.1:6379/0")
celery_app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_ignore_result=True,
    task_default_queue=settings.queue,
    broker_connection_retry_on_startup=True,
    # A redelivery after this is harmless (leases); it only bounds how long a lost
    # message stays lost before Redis hands it out again.
    broker_transport_options={"visibility_timeout": 3600},
    worker_hijack_root_logger=False,
    beat_schedule={
        "sweep": {"task": "batchwright.sweep", "schedule": settings.sweep_interval_seconds},
    },
    imports=("batchwright.tasks", "batchwright.worker.service"),
)
