"""Online requests of one model between the relay and its engine host.

A taker thread keeps the worker announced (relay liveness, what the API's 503 reads),
hands back what dead workers of the model held (the reaper), and takes requests from the
relay while the engine has rows for them: requests beyond `max_rows` in flight stay in
Redis, where any other live worker of the model may take them. Taken requests wait in an
inbox for the engine's next step (`take`, called by the engine: engine/online.py).

Everything else runs in the engine's thread, once a step: the events of the last step
(`Started` when the engine has a request, one `Delta` per streamed request, `Done` or
`Failed` at its end) go out in one pipeline before the next step's forward, and the ids
the API gave up are polled (one MGET) and dropped from the engine at that step.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from batchwright.config import Settings
from batchwright.engine.types import GenRequest, GenResult
from batchwright.protocol.chat import chat_id
from batchwright.relay.factory import worker_relay
from batchwright.relay.messages import ChoiceDelta, Delta, Done, Failed, Started
from batchwright.relay.worker_side import Taken, WorkerEvent
from batchwright.worker import metrics

if TYPE_CHECKING:
    from batchwright.engine.runtime import Engine

log = logging.getLogger(__name__)

# Body fields of the endpoint that the engine does not take (the worker streams).
_STREAM_FIELDS = ("stream", "stream_options")
# How often the taker hands back what dead workers held (besides the API's own reaping).
REAP_SECONDS = 2.0


class Host(Protocol):
    """What online work uses of its engine host (engine_host.EngineHost hands itself in;
    a protocol, so that the two modules do not import each other)."""

    model: str
    engine: Engine
    loaded: threading.Event
    online: OnlineWork | None

    def wake(self) -> None: ...


def worker_id() -> str:
    """The worker as the relay knows it (as its heartbeat row: host and pid)."""
    return f"{socket.gethostname()}:{os.getpid()}"


class OnlineWork:
    def __init__(self, host: Host, settings: Settings) -> None:
        self.host = host
        self.model = host.model
        self.settings = settings
        self.wid = worker_id()
        # A connection pool per thread: the taker's blocks in BLMPOP.
        self._in = worker_relay(self.wid, [self.model], settings)
        self._out = worker_relay(self.wid, [self.model], settings)
        self._lock = threading.Lock()
        self._inbox: deque[Taken] = deque()
        self.live: dict[str, Taken] = {}  # in the engine, by request id
        self._events: list[tuple[Any, WorkerEvent]] = []
        self._ended: list[Taken] = []  # last event queued: leave the taken list after it
        self._stop = threading.Event()
        self._room = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._take_loop, daemon=True, name="relay-take")

    # --- the taker thread ------------------------------------------------------------------

    def start(self) -> None:
        self._in.announce()
        self._thread.start()

    def stop(self) -> None:
        """Take no more requests (the ones held run to their end)."""
        self._stop.set()
        with self._lock:
            self._room.notify_all()
        self._thread.join(timeout=10)

    def leave(self) -> None:
        """The worker is going: not alive any more; what it still holds is handed back."""
        try:
            self._out.leave()
        except Exception as exc:
            log.warning("relay leave failed: %r", exc)

    def _take_loop(self) -> None:
        beat = max(0.05, self.settings.online_worker_ttl_seconds / 3)
        next_beat = next_reap = time.monotonic()
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                if now >= next_beat:
                    self._in.announce()
                    next_beat = now + beat
                if now >= next_reap:
                    self._in.reap()
                    next_reap = now + REAP_SECONDS
                wait = max(0.01, next_beat - time.monotonic())
                if not self._has_room(wait):
                    continue
                taken = self._in.take(timeout=wait)
                if taken is not None:
                    with self._lock:
                        self._inbox.append(taken)
                    self.host.wake()
            except Exception as exc:  # Redis away: keep trying, the key lapses meanwhile
                log.warning("relay: %r", exc)
                self._stop.wait(beat)

    def _has_room(self, wait: float) -> bool:
        """True when the engine can start one more request; else waits up to `wait` (its
        model may still be loading)."""
        if not self.host.loaded.wait(wait):
            return False
        with self._lock:
            if len(self._inbox) + len(self.live) < self.host.engine.max_rows:
                return True
            self._room.wait(wait)
            return False

    # --- the engine's feed (engine/online.py's OnlineFeed), in the engine's thread ---------

    def waiting(self) -> bool:
        return bool(self._inbox)

    def owns(self, key: Any) -> bool:
        return key in self.live

    def take(self) -> list[GenRequest]:
        self._flush()
        with self._lock:
            taken = list(self._inbox)
            self._inbox.clear()
        out = []
        for t in taken:
            r = t.request
            self.live[r.id] = t
            body = {k: v for k, v in r.body.items() if k not in _STREAM_FIELDS}
            out.append(GenRequest(r.id, body, stream=r.streamed))
        if out:
            metrics.handed(self.model, len(out))
            metrics.ONLINE_IN_FLIGHT.labels(self.model).set(len(self.live))
        return out

    def started(self, key: Any, prompt_tokens: int) -> None:
        t = self.live.get(key)
        if t is not None:
            fp = self.host.engine.system_fingerprint
            event = Started(worker=self.wid, system_fingerprint=fp, prompt_tokens=prompt_tokens)
            self._events.append((t.request, event))

    def emit(self, key: Any, deltas: list[dict[str, Any]]) -> None:
        t = self.live.get(key)
        if t is not None:
            choices = [ChoiceDelta.model_validate(d) for d in deltas]
            self._events.append((t.request, Delta(worker=self.wid, choices=choices)))

    def preempted(self, lines: int, rows: int) -> None:
        metrics.PREEMPTIONS.labels(self.model).inc(lines)

    def rows(self, online: int) -> None:
        metrics.ONLINE_ROWS.labels(self.model).set(online)

    # --- the host's side ---------------------------------------------------------------------

    def finished(self, result: GenResult) -> None:
        """A request's result: its Done (the Completion, with the request's id and
        creation time) or, when the engine refused it, its Failed."""
        t = self.live.pop(result.key)
        r = t.request
        if result.status_code == 200 and result.completion is not None:
            chat = result.completion.get("object") == "chat.completion"
            rid = chat_id(r.id) if chat else r.id
            completion = {**result.completion, "id": rid, "created": r.created}
            event: WorkerEvent = Done(worker=self.wid, completion=completion)
        else:
            error = result.error or {"message": "generation failed", "type": "server_error"}
            event = Failed(worker=self.wid, status=result.status_code, error=error)
        self._events.append((r, event))
        self._ended.append(t)
        metrics.finished(self.model, [result])
        self._left()

    def cancelled(self) -> set[Any]:
        """Ids in the engine that the API gave up: they leave it now, without events."""
        self._flush()
        if not self.live:
            return set()
        gone = self._out.cancelled(list(self.live))
        for key in gone:
            self._ended.append(self.live.pop(key))
        if gone:
            metrics.ONLINE_CANCELLED.labels(self.model).inc(len(gone))
            metrics.released(self.model, len(gone))
            self._left()
        return gone

    def fail_all(self, exc: BaseException) -> None:
        """The engine's run failed: every request it held ends with a 500."""
        error: dict[str, Any] = {
            "message": f"The engine failed: {exc!r}"[:500],
            "type": "server_error",
            "param": None,
            "code": "engine_error",
        }
        for t in self.live.values():
            self._events.append((t.request, Failed(worker=self.wid, status=500, error=error)))
            self._ended.append(t)
        metrics.released(self.model, len(self.live))
        self.live.clear()
        self._left()
        self._flush()

    def _left(self) -> None:
        metrics.ONLINE_IN_FLIGHT.labels(self.model).set(len(self.live))
        with self._lock:
            self._room.notify_all()

    def _flush(self) -> None:
        """Publish the queued events in one round trip; requests that ended leave the
        worker's taken list after their last event."""
        if self._events:
            events, self._events = self._events, []
            self._out.publish(events)
        if self._ended:
            ended, self._ended = self._ended, []
            for t in ended:
                self._out.finish(t)

    def drain(self) -> None:
        """Publish what the last step left (the engine is about to wait for input)."""
        self._flush()


def start_online(host: Host, settings: Settings) -> OnlineWork:
    work = OnlineWork(host, settings)
    host.online = work
    work.start()
    return work
