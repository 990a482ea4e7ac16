"""The worker's end of the relay (blocking redis-py; call it from the worker's own thread).

relay = WorkerRelay(redis.Redis.from_url(url), queue, worker_id, models)
relay.announce()                      # every ttl/3: this worker is alive, serves models
taken = relay.take(timeout=1.0)       # one request, or None
relay.publish([(taken.request, Started(worker=relay.worker_id))])
relay.publish([(req, Delta(...)) for req in this_step])   # one round trip a step
relay.cancelled([req.id for req in in_flight])            # ids the API gave up
relay.finish(taken)                   # after its Done or Failed event
relay.reap()                          # now and then: hand back what dead workers held
relay.leave()                         # on shutdown, after finishing what it holds
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import orjson
import redis

from batchwright.relay import scripts
from batchwright.relay.keys import RelayKeys
from batchwright.relay.messages import (
    FIELD,
    Delta,
    Done,
    Failed,
    OnlineRequest,
    Started,
    Tick,
    encode_event,
)

WorkerEvent = Started | Delta | Tick | Done | Failed
# A hard bound on a request's event stream (entries, trimmed approximately): far past what
# `max_unread_bytes` lets a request keep unread, so it never cuts events a reader needs.
MAX_STREAM_EVENTS = 100_000
WORKER_LOST_MESSAGE = (
    "The worker generating this completion stopped before it finished; retry the request."
)


@dataclass(frozen=True)
class Taken:
    request: OnlineRequest
    raw: str  # the exact string in Redis: it identifies the request in the taken list


class WorkerRelay:
    def __init__(
        self,
        client: redis.Redis,
        queue: str,
        worker_id: str,
        models: Sequence[str],
        *,
        ttl_seconds: float = 5.0,
        events_ttl_seconds: int = 3600,
        max_requeues: int = 3,
        max_unread_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        self.redis = client
        self.keys = RelayKeys(queue)
        self.worker_id = worker_id
        self.models = list(models)
        self.ttl_seconds = ttl_seconds
        self.events_ttl_seconds = events_ttl_seconds
        self.max_requeues = max_requeues
        self.max_unread_bytes = max_unread_bytes
        # Sizes of the events written per request, newest last (as many as may be unread),
        # and their sum.
        self._sizes: dict[str, tuple[deque[int], list[int]]] = {}
        self._take = client.register_script(scripts.TAKE)
        self._members = client.register_script(scripts.MEMBERS)
        self._reap = client.register_script(scripts.REAP)
        self._turn = 0

    # --- liveness ------------------------------------------------------------------------

    def announce(self, limits: dict[str, dict[str, Any]] | None = None) -> None:
        """This worker is alive for `ttl_seconds` more and serves its models; `limits`:
        what it knows of loaded ones (for the API's checks), kept as long."""
        pipe = self.redis.pipeline(transaction=False)
        ttl = int(self.ttl_seconds * 1000)
        pipe.set(self.keys.worker(self.worker_id), orjson.dumps(self.models), px=ttl)
        for model in self.models:
            pipe.sadd(self.keys.serving(model), self.worker_id)
        for model, known in (limits or {}).items():
            pipe.set(self.keys.limits(model), orjson.dumps(known), px=ttl)
        pipe.execute()

    def leave(self) -> tuple[int, int]:
        """Stop being alive; what this worker still holds is handed back as a dead worker's
        would be. (requeued, lost)."""
        self.redis.delete(self.keys.worker(self.worker_id))
        return self._reap_worker(self.worker_id, self.models)

    def reap(self) -> tuple[int, int]:
        """Hand back what dead workers of this worker's models held. (requeued, lost)."""
        requeued = lost = 0
        for model in self.models:
            _, dead = self._members(keys=[self.keys.serving(model)], args=[self.keys.prefix])
            for worker in dead:
                r, lo = self._reap_worker(_text(worker), [model])
                requeued, lost = requeued + r, lost + lo
        return requeued, lost

    def _reap_worker(self, worker: str, models: Iterable[str]) -> tuple[int, int]:
        keys, args = reap_call(
            self.keys, worker, models, self.max_requeues, self.events_ttl_seconds
        )
        return as_pair(self._reap(keys=keys, args=args))

    # --- requests ------------------------------------------------------------------------

    def take(self, timeout: float) -> Taken | None:
        """The next request for one of this worker's models, moved atomically into its taken
        list (exactly one worker gets it); None after `timeout` seconds without one.
        Requests the API already gave up (cancelled, past their deadline) are dropped."""
        end = time.monotonic() + timeout
        # Start at a different model each call, so one busy model does not starve another.
        self._turn = (self._turn + 1) % max(1, len(self.models))
        order = self.models[self._turn :] + self.models[: self._turn]
        keys = [
            self.keys.taken(self.worker_id),
            *(self.keys.pending(m) for m in order),
            *(self.keys.bell(m) for m in order),
        ]
        while True:
            raw = self._take(keys=keys, args=[len(order)])
            if raw:
                taken = Taken(OnlineRequest.decode(raw), _text(raw))
                if taken.request.expired() or self.redis.exists(self.keys.cancel(taken.request.id)):
                    self.finish(taken)
                    continue
                return taken
            left = end - time.monotonic()
            if left <= 0:
                return None
            # Sleep until a submit rings a bell of one of these models (or the time is up).
            self.redis.blmpop(max(left, 0.01), len(order), *keys[1 + len(order) :],
                              direction="LEFT")  # fmt: skip

    def finish(self, taken: Taken) -> bool:
        """The request left this worker (its last event is published). False when it had been
        handed back meanwhile (this worker was taken for dead)."""
        return bool(self.redis.lrem(self.keys.taken(self.worker_id), 1, taken.raw))

    def publish(
        self, events: Iterable[tuple[OnlineRequest, WorkerEvent | dict[str, Any]]]
    ) -> set[str]:
        """Append events to their requests' streams, all in one round trip (each event's
        `attempt` is set to its request's). An event may come as the JSON object of a
        Delta (the engine's deltas, every step: no model built for them). Every add renews
        the stream's time to live (the API deletes a stream it left; a late event must not
        re-create it for good) and bounds it.

        Returns the ids of requests whose reader lags: the API trims what it read, so what
        a stream holds is what was not read; past `max_unread_bytes` of it the client is
        taken to have stopped reading (the caller drops the request)."""
        pipe = self.redis.pipeline(transaction=False)
        sent: list[tuple[str, int]] = []
        for request, event in events:
            key = self.keys.events(request.id)
            if isinstance(event, dict):
                event["attempt"] = request.attempt
                data = orjson.dumps(event)
            else:
                event.attempt = request.attempt
                data = encode_event(event)
            pipe.xadd(key, {FIELD: data}, maxlen=MAX_STREAM_EVENTS, approximate=True)
            pipe.expire(key, self.events_ttl_seconds)
            pipe.xlen(key)
            sent.append((request.id, len(data)))
        if not sent:
            return set()
        replies = pipe.execute()
        lagging: set[str] = set()
        for (rid, size), unread in zip(sent, replies[2::3], strict=True):
            sizes, total = self._sizes.setdefault(rid, (deque(), [0]))
            sizes.append(size)
            total[0] += size
            while len(sizes) > int(unread):
                total[0] -= sizes.popleft()
            if total[0] > self.max_unread_bytes:
                lagging.add(rid)
        return lagging

    def forget(self, request_id: str) -> None:
        """The request sends nothing more: its bookkeeping goes."""
        self._sizes.pop(request_id, None)

    def cancelled(self, request_ids: Sequence[str]) -> set[str]:
        """The ids among these that the API gave up (client gone, deadline passed)."""
        if not request_ids:
            return set()
        flags = self.redis.mget([self.keys.cancel(i) for i in request_ids])
        return {i for i, flag in zip(request_ids, flags, strict=True) if flag is not None}


def reap_call(
    keys: RelayKeys, worker: str, models: Iterable[str], max_requeues: int, events_ttl: int
) -> tuple[list[str], list[Any]]:
    """Keys and arguments of the reap script for one worker (both ends of the relay run it)."""
    return (
        [keys.worker(worker), keys.taken(worker)],
        [
            keys.prefix,
            worker,
            max_requeues,
            events_ttl,
            WORKER_LOST_MESSAGE,
            *(keys.serving(m) for m in models),
        ],
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def as_pair(result: Any) -> tuple[int, int]:
    if result == -1:
        return 0, 0
    pair = cast(list[int], result)
    return int(pair[0]), int(pair[1])
