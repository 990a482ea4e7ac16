"""The relay's two ends built from Settings (the broker URL, the queue, the online_* knobs)."""

from __future__ import annotations

from collections.abc import Sequence

import redis
import redis.asyncio as aioredis

from batchwright.config import Settings, get_settings
from batchwright.relay.api_side import ApiRelay
from batchwright.relay.worker_side import WorkerRelay


def worker_relay(
    worker_id: str, models: Sequence[str], settings: Settings | None = None
) -> WorkerRelay:
    """A worker's relay on its own connection pool (blocking calls: use it from one thread,
    or one relay per thread)."""
    settings = settings or get_settings()
    client = redis.Redis.from_url(settings.broker_url, health_check_interval=30)
    return WorkerRelay(
        client,
        settings.queue,
        worker_id,
        models,
        ttl_seconds=settings.online_worker_ttl_seconds,
        events_ttl_seconds=settings.online_events_ttl_seconds,
        max_requeues=settings.online_max_requeues,
    )


def api_relay(settings: Settings | None = None) -> ApiRelay:
    """The API process's relay; create it inside the event loop that will use it."""
    settings = settings or get_settings()
    client = aioredis.Redis.from_url(settings.broker_url, health_check_interval=30)
    return ApiRelay(
        client,
        settings.queue,
        events_ttl_seconds=settings.online_events_ttl_seconds,
        cancel_ttl_seconds=settings.online_events_ttl_seconds,
        max_requeues=settings.online_max_requeues,
        liveness_check_seconds=min(1.0, settings.online_worker_ttl_seconds / 3),
    )
