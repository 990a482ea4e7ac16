"""The API's end of the relay (redis.asyncio: one event loop holds many connections).

    relay = ApiRelay(redis.asyncio.Redis.from_url(url), queue)
    if not await relay.live_workers(model): ...        # 503 at once
    follower = await relay.submit(request)
    event = await follower.next()   # None: deadline passed before a worker started it
    ...
    await follower.cancel()          # client gone: the worker drops its rows
    await follower.close()           # events no longer needed
    await relay.close()              # the process ends

Events of every follower come through one blocking read (reader.py), so a waiting request
holds no connection; `redis` serves the short commands (a bounded pool in the API: see
factory.py). Memory per request is bounded: a follower holds at most `read_count` events
read ahead; the rest wait in Redis.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import orjson
import redis.asyncio as aioredis

from batchwright.relay import scripts
from batchwright.relay.keys import RelayKeys
from batchwright.relay.messages import (
    FIELD,
    STALLED,
    Event,
    Failed,
    OnlineRequest,
    Started,
    Tick,
    decode_event,
)
from batchwright.relay.reader import StreamReader
from batchwright.relay.worker_side import as_pair, reap_call

# Bells kept per model: enough to wake every idle worker, bounded when none listens.
_BELLS = 1024


class ApiRelay:
    def __init__(
        self,
        client: aioredis.Redis,
        queue: str,
        *,
        events_ttl_seconds: int = 3600,
        cancel_ttl_seconds: int = 3600,
        max_requeues: int = 3,
        liveness_check_seconds: float = 1.0,
        read_count: int = 64,
        idle_timeout_seconds: float = 0.0,
        reader_client: aioredis.Redis | None = None,
    ) -> None:
        self.redis = client
        self.keys = RelayKeys(queue)
        self.events_ttl_seconds = events_ttl_seconds
        self.cancel_ttl_seconds = cancel_ttl_seconds
        self.max_requeues = max_requeues
        self.liveness_check_seconds = liveness_check_seconds
        self.read_count = read_count
        # A started request whose worker sends nothing (not even a tick) this long is given
        # up: its engine is stuck though the worker still announces itself. 0: never.
        self.idle_timeout_seconds = idle_timeout_seconds
        self._members = client.register_script(scripts.MEMBERS)
        self._reap = client.register_script(scripts.REAP)
        if reader_client is None:
            # A connection of its own, to the client's Redis, with a socket timeout longer
            # than the read's block.
            pool = client.connection_pool
            kwargs = dict(pool.connection_kwargs)
            timeout = kwargs.get("socket_timeout")
            kwargs["socket_timeout"] = None if timeout is None else max(timeout, 5.0) + 1.0
            own = aioredis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
            reader_client = aioredis.Redis(connection_pool=own)
        self.reader = StreamReader(
            reader_client,
            client,
            self.keys.prefix,
            count=read_count,
            block_seconds=liveness_check_seconds,
        )

    async def close(self) -> None:
        await self.reader.close()

    async def live_workers(self, model: str) -> list[str]:
        live, _ = await self._members(keys=[self.keys.serving(model)], args=[self.keys.prefix])
        return sorted(w.decode() if isinstance(w, bytes) else w for w in live)

    async def reap(self, model: str) -> tuple[int, int]:
        """Hand back what dead workers of `model` held. (requeued, lost)."""
        _, dead = await self._members(keys=[self.keys.serving(model)], args=[self.keys.prefix])
        requeued = lost = 0
        for worker in dead:
            r, lo = await self.reap_worker(worker.decode(), [model])
            requeued, lost = requeued + r, lost + lo
        return requeued, lost

    async def reap_worker(self, worker: str, models: Iterable[str]) -> tuple[int, int]:
        keys, args = reap_call(
            self.keys, worker, models, self.max_requeues, self.events_ttl_seconds
        )
        return as_pair(await self._reap(keys=keys, args=args))

    async def model_limits(self, model: str) -> dict[str, Any] | None:
        """What live workers announced of `model` (worker_side.WorkerRelay.announce)."""
        raw = await self.redis.get(self.keys.limits(model))
        if not raw:
            return None
        found = orjson.loads(raw)
        return found if isinstance(found, dict) else None

    async def alive(self, worker: str) -> bool:
        return bool(await self.redis.exists(self.keys.worker(worker)))

    async def submit(self, request: OnlineRequest) -> Follower:
        """Queue the request for the workers of its model; follow its events."""
        follower = Follower(self, request)
        await follower.push()
        return follower


class Follower:
    """One request's events, as the API sees them: only the current attempt's, and only
    from the worker that started it (a worker taken for dead that comes back is ignored)."""

    def __init__(self, relay: ApiRelay, request: OnlineRequest) -> None:
        self.relay = relay
        self.request = request
        self.raw = request.encode()
        self.worker: str | None = None
        self.started: Started | None = None
        self._buffer: list[Event] = []
        self._sub = relay.reader.follow(self.keys.events(request.id))
        self._heard = time.monotonic()  # the last event of the worker followed

    @property
    def keys(self) -> RelayKeys:
        return self.relay.keys

    async def push(self) -> None:
        model = self.request.model
        async with self.relay.redis.pipeline(transaction=True) as pipe:
            pipe.lpush(self.keys.pending(model), self.raw)
            pipe.lpush(self.keys.bell(model), b"1")
            pipe.ltrim(self.keys.bell(model), 0, _BELLS - 1)
            self.relay.reader.wake_commands(pipe)
            await pipe.execute()

    async def resubmit(self) -> None:
        """Queue the request again as its next attempt (its worker died mid-generation);
        events of the earlier attempt are ignored from here on."""
        self.request = self.request.model_copy(update={"attempt": self.request.attempt + 1})
        self.raw = self.request.encode()
        self.worker, self.started = None, None
        await self.push()

    async def next(self) -> Event | None:
        """The next event that counts. Before a worker started the request: None once its
        deadline passed (it is then cancelled, so no worker starts it later). After: waits
        as long as the worker lives and sends something within the idle timeout; a dead
        worker's request gets a `worker_lost` Failed, a silent one's an `engine_stalled`
        Failed (and is cancelled). Redis errors propagate (reader.ReaderDown too)."""
        last_check = time.monotonic()
        check_every = self.relay.liveness_check_seconds
        while True:
            if self._buffer:
                return self._buffer.pop(0)
            if self.worker is None:
                left = self.request.deadline - time.time()
                if left <= 0:
                    # Given up; a worker that took it this instant drops it (cancelled).
                    await self.cancel()
                    return None
                block = min(left, check_every)
            else:
                block = check_every
                idle = self.relay.idle_timeout_seconds
                if idle > 0 and time.monotonic() - self._heard > idle:
                    await self.cancel()
                    return self._stalled(idle)
            for _, fields in await self._sub.take(block):
                event = decode_event(fields[FIELD])
                if self._counts(event):
                    self._heard = time.monotonic()
                    if not isinstance(event, Tick):
                        self._buffer.append(event)
            if self._buffer:
                continue
            if time.monotonic() - last_check >= check_every:
                last_check = time.monotonic()
                await self._check_liveness()

    def _stalled(self, idle: float) -> Failed:
        return Failed(
            worker=self.worker or "",
            attempt=self.request.attempt,
            status=503,
            error={
                "message": f"The worker generating this completion sent nothing for {idle:g} "
                "s (BATCHWRIGHT_ONLINE_IDLE_TIMEOUT_SECONDS); the request was given up. "
                "Retry it.",
                "type": "server_error",
                "param": None,
                "code": STALLED,
            },
        )

    def _counts(self, event: Event) -> bool:
        if event.attempt != self.request.attempt:
            return False
        if self.worker is None:
            if isinstance(event, Tick):
                return False
            # The first worker to speak for this attempt is the one to follow (a request
            # that needs no engine step may end with Done or Failed before any Started).
            self.worker = event.worker
            if isinstance(event, Started):
                self.started = event
            return True
        if isinstance(event, Started):
            return False  # another worker started it too (it was handed back)
        return event.worker == self.worker

    async def _check_liveness(self) -> None:
        if self.worker is None:
            # A worker that died holding it before it started: hand it to another one.
            await self.relay.reap(self.request.model)
        elif not await self.relay.alive(self.worker):
            await self.relay.reap_worker(self.worker, [self.request.model])

    async def cancel(self) -> bool:
        """Give the request up (client gone, deadline passed): withdrawn if still waiting,
        else its worker drops it at its next engine step. True when it was still waiting."""
        async with self.relay.redis.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.cancel(self.request.id), b"1", ex=self.relay.cancel_ttl_seconds)
            pipe.lrem(self.keys.pending(self.request.model), 1, self.raw)
            _, removed = await pipe.execute()
        return bool(removed)

    async def close(self) -> None:
        """Stop following; the events left in Redis go (the worker's later ones expire)."""
        self._sub.close()
        await self.relay.redis.delete(self.keys.events(self.request.id))
