"""The API's Prometheus endpoint: request counts and latency per route, and the state of
the queue read from Postgres at scrape time (batches by status, lines per model, the age
of the oldest queued line, live workers).

Several API processes (`serve --workers N`): set PROMETHEUS_MULTIPROC_DIR and the request
metrics of all of them are summed (prometheus-client's multiprocess mode).

Not public: on the API's own port /metrics answers only a request that carries
`Authorization: Bearer <BATCHWRIGHT_METRICS_KEY>` (404 while no key is set, 401 for a
wrong one); `serve` can also start a listener of its own for it
(BATCHWRIGHT_METRICS_PORT, on BATCHWRIGHT_METRICS_HOST), where Prometheus scrapes without
a key (compose: inside its network only).
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable

from fastapi import APIRouter, FastAPI, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from batchwright.config import Settings, get_settings
from batchwright.controlplane.heartbeats import capacity
from batchwright.db.models import Batch, BatchRequest
from batchwright.db.session import session_scope
from batchwright.errors import NotFound, Unauthorized

REQUESTS = Counter(
    "batchwright_http_requests_total", "HTTP requests", ["method", "route", "status"]
)
LATENCY = Histogram(
    "batchwright_http_request_duration_seconds", "HTTP request latency", ["method", "route"]
)

log = logging.getLogger(__name__)
router = APIRouter()
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class QueueCollector(Collector):
    """Queue state from the database, once per scrape."""

    def collect(self) -> Iterable[Metric]:
        batches = GaugeMetricFamily("batchwright_batches", "Batches by status", labels=["status"])
        lines = GaugeMetricFamily(
            "batchwright_lines", "Unfinished lines per model and state", labels=["model", "state"]
        )
        oldest = GaugeMetricFamily(
            "batchwright_oldest_queued_line_age_seconds",
            "Age of the oldest queued line per model (since its batch started)",
            labels=["model"],
        )
        workers = GaugeMetricFamily(
            "batchwright_workers_live", "Workers with a live heartbeat per model", labels=["model"]
        )
        now = time.time()
        with session_scope() as session:
            for status, count in session.execute(
                select(Batch.status, func.count()).group_by(Batch.status)
            ):
                batches.add_metric([status], count)
            unfinished = (
                select(Batch.model, BatchRequest.state, func.count())
                .join(Batch, Batch.id == BatchRequest.batch_id)
                .where(BatchRequest.state.in_(("queued", "running")))
                .group_by(Batch.model, BatchRequest.state)
            )
            for model, state, count in session.execute(unfinished):
                lines.add_metric([model or "", state], count)
            has_queued = (
                select(BatchRequest.id)
                .where(BatchRequest.batch_id == Batch.id, BatchRequest.state == "queued")
                .exists()
            )
            for model, started in session.execute(
                select(Batch.model, func.min(Batch.in_progress_at))
                .where(Batch.status == "in_progress", has_queued)
                .group_by(Batch.model)
            ):
                oldest.add_metric([model or ""], max(0.0, now - (started or now)))
            for model, count in capacity(session, get_settings()).items():
                workers.add_metric([model], count)
        yield from (batches, lines, oldest, workers)


def _registry() -> CollectorRegistry:
    from prometheus_client import REGISTRY

    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        return REGISTRY
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return registry


_queue_registry = CollectorRegistry()
_queue_registry.register(QueueCollector())


def metrics_reader(authorization: str | None, settings: Settings) -> bool:
    """Whether a request may read metrics and capacity on the API's port: it carries the
    metrics key (compared in constant time)."""
    key = settings.metrics_key
    if not key or not authorization:
        return False
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    settings = get_settings()
    if not settings.metrics_key:
        raise NotFound(
            "Metrics are not served on this port: set BATCHWRIGHT_METRICS_KEY (then send it "
            "as a bearer token), or scrape the listener at BATCHWRIGHT_METRICS_PORT."
        )
    if not metrics_reader(request.headers.get("authorization"), settings):
        raise Unauthorized("Metrics need the metrics key (BATCHWRIGHT_METRICS_KEY).")
    return Response(_exposition(), media_type=CONTENT_TYPE_LATEST)


def _exposition() -> bytes:
    return generate_latest(_registry()) + generate_latest(_queue_registry)


class _Both(Collector):
    """The process's (or processes') metrics and the queue's, for the listener."""

    def collect(self) -> Iterable[Metric]:
        yield from _registry().collect()
        yield from _queue_registry.collect()


def start_listener(settings: Settings) -> bool:
    """The metrics listener of its own, when a port is set (a daemon thread of `serve`)."""
    if not settings.metrics_port:
        return False
    from prometheus_client import start_http_server

    both = CollectorRegistry(auto_describe=False)
    both.register(_Both())
    try:
        start_http_server(settings.metrics_port, settings.metrics_host, registry=both)
    except OSError as exc:  # the port is taken: the API serves on without it
        where = f"{settings.metrics_host}:{settings.metrics_port}"
        log.error("metrics listener on %s: %s", where, exc)
        return False
    return True


def install(app: FastAPI) -> None:
    @app.middleware("http")
    async def _observe(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        start = time.perf_counter()
        status = 500
        try:
            response = await call_next(request)
            status = response.status_code
            return response
        finally:
            route = request.scope.get("route")
            # The route's template, not the path: ids would make a series per batch; and a
            # method a client made up is "other" (labels are never a client's strings).
            path = getattr(route, "path", "unmatched")
            method = request.method if request.method in _METHODS else "other"
            REQUESTS.labels(method, path, str(status)).inc()
            LATENCY.labels(method, path).observe(time.perf_counter() - start)

    app.include_router(router)
