"""Per-process services of a Celery worker: its heartbeat, its Prometheus endpoint and
its engine hosts (one engine loop per served model, taking online requests too).

Started once the worker is ready (never at import or fork) and stopped at shutdown.
"""

from __future__ import annotations

from typing import Any

from celery.signals import task_retry, worker_ready, worker_shutdown

from batchwright.config import get_settings
from batchwright.controlplane.routing import served_models
from batchwright.worker import metrics
from batchwright.worker.generation import hosts
from batchwright.worker.stats import Heartbeat

_heartbeat: Heartbeat | None = None


def _start(**_: Any) -> None:
    global _heartbeat
    settings = get_settings()
    if settings.worker_metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.worker_metrics_port)
    # Control work is a control-only worker's (a generation worker's companion, say).
    _heartbeat = Heartbeat(served_models(settings), settings.worker_control_only, settings)
    _heartbeat.start()
    hosts.start(settings)


def _stop(**_: Any) -> None:
    # The tasks have ended (a warm shutdown finished its lease): online requests held
    # run to their end, the rest is handed to other workers.
    hosts.stop_all()
    if _heartbeat is not None:
        _heartbeat.stop()


def _retried(sender: Any = None, **_: Any) -> None:
    metrics.RETRIES.labels(getattr(sender, "name", "unknown")).inc()


worker_ready.connect(_start, weak=False)
worker_shutdown.connect(_stop, weak=False)
task_retry.connect(_retried, weak=False)
