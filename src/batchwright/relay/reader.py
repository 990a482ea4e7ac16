"""Every followed event stream of an API process, read by one blocking XREAD.

A connection per waiting request does not scale: redis-py's pool stopped at 100 and every
request past it failed at once (issue 33). Here one task holds one connection and blocks
in `XREAD BLOCK` on all the streams followed at the time, plus a wake stream of its own;
a new follower (or one whose buffer drained) rings the wake stream, so the read starts
over with it included. Each follower gets its entries in a buffer of `count` entries at
most: a follower that stops taking them (its client does not read) is left out of the
read until it does, so its events wait in Redis (where the worker sees the backlog and
gives the request up) rather than in this process's memory. Entries read are trimmed
from their stream (all but the last, which the reaper reads), so Redis keeps only what
was not read yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

# How long the wake stream lives without a new follower (it is re-created by the next).
_WAKE_TTL = 3600


class ReaderDown(Exception):
    """The reader could not read from Redis: the follower's request has no events."""


class Subscription:
    """One stream's entries as the reader hands them over: `(id, fields)` pairs."""

    def __init__(self, reader: StreamReader, key: str) -> None:
        self.reader = reader
        self.key = key
        self.last_id: Any = "0-0"
        self.entries: deque[tuple[Any, dict[Any, Any]]] = deque()
        self.error: BaseException | None = None
        self._ready = asyncio.Event()

    @property
    def full(self) -> bool:
        return len(self.entries) >= self.reader.count

    def _feed(self, entries: list[tuple[Any, dict[Any, Any]]]) -> None:
        for entry_id, fields in entries:
            self.last_id = entry_id
            self.entries.append((entry_id, fields))
        self._ready.set()

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        self._ready.set()

    async def take(self, timeout: float) -> list[tuple[Any, dict[Any, Any]]]:
        """The entries read so far (waiting up to `timeout` s for one); raises ReaderDown
        when Redis failed the read."""
        if not self.entries and self.error is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), timeout)
        self._ready.clear()
        if self.error is not None and not self.entries:
            raise ReaderDown(str(self.error)) from self.error
        was_full = self.full
        out = list(self.entries)
        self.entries.clear()
        if was_full:
            await self.reader.wake()  # read again: it was left out while full
        return out

    def close(self) -> None:
        self.reader._drop(self)


class StreamReader:
    def __init__(
        self,
        client: aioredis.Redis,
        wake_client: aioredis.Redis,
        prefix: str,
        *,
        count: int = 64,
        block_seconds: float = 1.0,
    ) -> None:
        # `client`: a connection for the blocking read alone (its socket timeout must be
        # longer than the block); `wake_client`: the relay's pool, for short commands.
        self.redis = client
        self.wake_redis = wake_client
        self.count = count
        self.block_ms = max(1, int(block_seconds * 1000))
        self.wake_key = f"{prefix}:reader:{uuid.uuid4().hex}"
        self._subs: dict[str, Subscription] = {}
        self._changed = asyncio.Event()
        self._wake_id: Any = "0-0"
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def follow(self, key: str) -> Subscription:
        sub = Subscription(self, key)
        self._subs[key] = sub
        self._changed.set()
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())
        return sub

    def _drop(self, sub: Subscription) -> None:
        if self._subs.get(sub.key) is sub:
            del self._subs[sub.key]

    def wake_commands(self, pipe: Any) -> None:
        """Queue the wake on `pipe` (a submit sends it with the request: no extra trip)."""
        pipe.xadd(self.wake_key, {b"w": b"1"}, maxlen=1)
        pipe.expire(self.wake_key, _WAKE_TTL)

    async def wake(self) -> None:
        async with self.wake_redis.pipeline(transaction=False) as pipe:
            self.wake_commands(pipe)
            await pipe.execute()

    async def close(self) -> None:
        """Stop reading: the read in flight ends at its block (a cancel in the middle of a
        read can leave redis-py waiting for good), then the connection closes."""
        self._closed = True
        self._changed.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), self.block_ms / 1000 + 2)
            except BaseException:
                self._task.cancel()
        with contextlib.suppress(Exception):
            await self.redis.aclose()

    async def _run(self) -> None:
        task = asyncio.current_task()
        while not self._closed:
            if not self._subs:
                self._changed.clear()
                await self._changed.wait()
                continue
            streams: dict[Any, Any] = {k: s.last_id for k, s in self._subs.items() if not s.full}
            streams[self.wake_key] = self._wake_id
            try:
                reply: Any = await self.redis.xread(streams, count=self.count, block=self.block_ms)
                await self._trim(self._deliver(reply or []))
            except Exception as exc:
                if task is not None and task.cancelling():
                    # redis-py turns a cancel in the middle of a read into its own error.
                    raise asyncio.CancelledError() from exc
                if isinstance(exc, RedisError | OSError):
                    log.warning("relay reader: %r", exc)
                else:  # a bug must not leave every stream of the process unread
                    log.exception("relay reader failed")
                for sub in list(self._subs.values()):
                    sub._fail(exc)
                await asyncio.sleep(0.2)  # Redis is away: the next followers retry it

    def _deliver(self, reply: list[Any]) -> list[tuple[str, Any]]:
        read = []
        for raw_key, entries in reply:
            key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
            if key == self.wake_key:
                self._wake_id = entries[-1][0]
                continue
            sub = self._subs.get(key)
            if sub is None or not entries:
                continue
            sub._feed(entries)
            read.append((key, entries[-1][0]))
        return read

    async def _trim(self, read: list[tuple[str, Any]]) -> None:
        """What was read leaves Redis (the last entry stays: the reaper reads it)."""
        if not read:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for key, last in read:
                # Exact: approximate trimming frees only whole nodes of 100 entries.
                pipe.xtrim(key, minid=last, approximate=False)
            await pipe.execute()
