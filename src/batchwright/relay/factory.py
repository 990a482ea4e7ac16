"""The relay's two ends built from Settings (the broker URL, the queue, the online_* knobs)."""

from __future__ import annotations

from collections.abc import Sequence

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from batchwright.config import Settings, get_settings
from batchwright.relay.api_side import ApiRelay
from batchwright.relay.worker_side import WorkerRelay


def worker_relay(
    worker_id: str, models: Sequence[str], settings: Settings | None = None
) -> WorkerRelay:
    """A worker's relay on its own connection pool (blocking calls: use it from one thread,
    or one relay per thread)."""
    settings = settings or get_settings()
    # A socket timeout beyond the longest block (the taker's BLMPOP waits up to a third of
    # the liveness TTL): a hung Redis fails a call instead of holding the thread forever.
    timeout = settings.online_redis_timeout_seconds + settings.online_worker_ttl_seconds
    client = redis.Redis.from_url(
        settings.broker_url,
        health_check_interval=30,
        socket_timeout=timeout,
        socket_connect_timeout=settings.online_redis_timeout_seconds,
    )
    return WorkerRelay(
        client,
        settings.queue,
        worker_id,
        models,
        ttl_seconds=settings.online_worker_ttl_seconds,
        events_ttl_seconds=settings.online_events_ttl_seconds,
        max_requeues=settings.online_max_requeues,
        max_unread_bytes=settings.online_max_unread_bytes,
    )


def _reconnect() -> Retry:
    """A command whose pooled connection Redis closed (a restart, a client kill, an idle
    timeout) is sent again on a new one (twice at most), instead of failing with a 503
    while Redis is up. Connection errors only: a timeout may mean the command ran. A
    pool built from a URL has no retries (redis-py gives its default to clients that
    build their own pool only)."""
    return Retry(ExponentialBackoff(cap=0.5, base=0.05), 2, (RedisConnectionError,))


def api_relay(settings: Settings | None = None) -> ApiRelay:
    """The API process's relay; create it inside the event loop that will use it.

    Short commands share a bounded pool: past `online_redis_connections` busy at once a
    command waits up to `online_redis_pool_timeout_seconds` for one, then raises (the
    endpoint's 503 with Retry-After), instead of opening connections without end. Every
    command has a socket timeout, so a hung Redis cannot hold a request (or the clean-up
    after it) forever. Events are read by the relay's reader on a connection of its own."""
    settings = settings or get_settings()
    timeout = settings.online_redis_timeout_seconds
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.broker_url,
        max_connections=settings.online_redis_connections,
        timeout=settings.online_redis_pool_timeout_seconds,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        health_check_interval=30,
        retry=_reconnect(),
    )
    client = aioredis.Redis(connection_pool=pool)
    liveness = min(1.0, settings.online_worker_ttl_seconds / 3)
    reader = aioredis.Redis.from_url(
        settings.broker_url,
        socket_timeout=timeout + liveness,
        socket_connect_timeout=timeout,
        health_check_interval=30,
        retry=_reconnect(),
    )
    return ApiRelay(
        client,
        settings.queue,
        events_ttl_seconds=settings.online_events_ttl_seconds,
        cancel_ttl_seconds=settings.online_events_ttl_seconds,
        max_requeues=settings.online_max_requeues,
        liveness_check_seconds=liveness,
        idle_timeout_seconds=settings.online_idle_timeout_seconds,
        reader_client=reader,
    )
