"""The relay pump: a model's online requests between the relay and its engine host.

Two threads talk to Redis so that the engine's never does:

- the taker keeps the worker announced (relay liveness: what the API's 503 reads), hands
  back what dead workers of the model held (the reaper), and takes requests while the
  engine has rows for them: requests beyond `max_rows` in flight stay in Redis, where any
  other live worker of the model may take them. Taken requests wait in an inbox for the
  engine's next step (`take`, engine/scheduling/lane.py);
- the publisher sends what the engine's steps queued (`Started` when the engine has a
  request, one `Delta` per streamed request and step, `Done` or `Failed` at its end) in
  one pipeline per wake-up, takes ended requests off the worker's taken list after their
  last event, and polls the ids the API gave up (one MGET) for the engine's next step.

The engine's thread only queues events and reads the cancels found (the lane's feed,
engine/requests/feed.py's LaneFeed, and `finished`/`cancelled` for the host): a step never
waits on a round trip.
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
from batchwright.engine.requests.jobs import server_error
from batchwright.engine.requests.request import EngineRequest
from batchwright.engine.requests.types import GenRequest, GenResult
from batchwright.protocol.chat import chat_id
from batchwright.protocol.embeddings import is_embedding_body
from batchwright.relay.factory import worker_relay
from batchwright.relay.messages import (
    ChoiceDelta,
    Done,
    Failed,
    OnlineRequest,
    Started,
    Tick,
)
from batchwright.relay.worker_side import Taken, WorkerEvent
from batchwright.worker import metrics
from batchwright.worker.adapters import adapter_of

if TYPE_CHECKING:
    from batchwright.engine.engine import Engine
    from batchwright.serving.prepare import Prepare

log = logging.getLogger(__name__)

# Body fields of the endpoint that the engine does not take (the worker streams).
_STREAM_FIELDS = ("stream", "stream_options")
# How often the taker hands back what dead workers held (besides the API's own reaping).
REAP_SECONDS = 2.0
# How often the publisher looks for cancels while requests run (one MGET): a client that
# left is dropped within this and a step. Every 10 ms the polls took a third of the
# worker's Python time beside 16 streams (py-spy), and the GIL from the loop.
CANCEL_POLL_SECONDS = 0.05
# A request the engine holds gets at least one event this often (a Tick when nothing else
# went to it), from the engine's own thread: the API's idle timeout tells a stuck engine
# from a long request by their absence.
TICK_SECONDS = 1.0
# What a client reads after the error event of a request it did not read fast enough.
_LAGGING = {
    "message": "The client did not read this stream: more than "
    "BATCHWRIGHT_ONLINE_MAX_UNREAD_BYTES of it waited unread, so the request was stopped.",
    "type": "invalid_request_error",
    "param": None,
    "code": "stream_not_read",
}
# What a client learns of an engine that failed (the exception goes to the worker's log).
_ENGINE_FAILED = {
    "message": "The worker's engine failed while it held this request; retry it.",
    "type": "server_error",
    "param": None,
    "code": "engine_error",
}


class Host(Protocol):
    """What the pump uses of its engine host (engine_host.EngineHost hands itself in;
    a protocol, so that the two modules do not import each other)."""

    model: str
    engine: Engine
    prepare: Prepare | None  # the engine's preparer (serving/prepare.py), None: lines as-is
    loaded: threading.Event
    online: RelayPump | None

    def wake(self) -> None: ...


def worker_id() -> str:
    """The worker as the relay knows it (as its heartbeat row: host and pid)."""
    return f"{socket.gethostname()}:{os.getpid()}"


class RelayPump:
    """One model's pump: the taker and publisher threads, and the engine's lane feed."""

    def __init__(self, host: Host, settings: Settings) -> None:
        self.host = host
        self.model = host.model
        self.settings = settings
        self.wid = worker_id()
        # A connection pool per thread: the taker blocks in BLMPOP.
        self._in = worker_relay(self.wid, [self.model], settings)
        self._out = worker_relay(self.wid, [self.model], settings)
        self._lock = threading.Condition()
        self._inbox: deque[tuple[Taken, EngineRequest | GenResult]] = deque()
        self.live: dict[str, Taken] = {}  # in the engine, by request id (engine thread)
        self._running: dict[str, Taken] = {}  # the same, as the publisher polls them
        self._events: list[tuple[OnlineRequest, WorkerEvent | dict[str, Any]]] = []
        self._ended: list[Taken] = []  # last event queued: leave the taken list after it
        self._cancels: set[str] = set()  # found by the publisher, for the engine
        self._heard: dict[str, float] = {}  # last event queued per request (engine thread)
        self._known: dict[str, int] | None = None  # announced limits of the model
        self._ticked = time.monotonic()
        self._stop = threading.Event()
        self._done = False  # the publisher's last round
        self._taker = threading.Thread(target=self._take_loop, daemon=True, name="relay-take")
        self._publisher = threading.Thread(target=self._publish_loop, daemon=True, name="relay-out")

    # --- life ------------------------------------------------------------------------------

    def start(self) -> None:
        self._in.announce()
        self._taker.start()
        self._publisher.start()

    def stop(self) -> None:
        """Take no more requests (the ones held run to their end)."""
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        self._taker.join(timeout=10)

    def leave(self) -> None:
        """The worker is going: what is queued goes out, then the worker is not alive any
        more and what it still holds is handed back."""
        with self._lock:
            self._done = True
            self._lock.notify_all()
        self._publisher.join(timeout=10)
        try:
            self._out.leave()
        except Exception as exc:
            log.warning("relay leave failed: %r", exc)

    # --- the taker thread ------------------------------------------------------------------

    def _take_loop(self) -> None:
        beat = max(0.05, self.settings.online_worker_ttl_seconds / 3)
        next_beat = next_reap = time.monotonic()
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                if now >= next_beat:
                    self._in.announce(self._limits())
                    next_beat = now + beat
                if now >= next_reap:
                    self._in.reap()
                    next_reap = now + REAP_SECONDS
                wait = max(0.01, next_beat - time.monotonic())
                if not self._has_room(wait):
                    continue
                taken = self._in.take(timeout=wait)
                if taken is not None:
                    prepared = self._prepare(taken.request)
                    with self._lock:
                        self._inbox.append((taken, prepared))
                    self.host.wake()
            except Exception as exc:  # Redis away: keep trying, the key lapses meanwhile
                log.warning("relay: %r", exc)
                self._stop.wait(beat)

    def _limits(self) -> dict[str, dict[str, Any]] | None:
        """What the API may check of the model before sending it a request (once loaded):
        its context length, and the longest token of its vocabulary in bytes (a text
        prompt longer than their product cannot fit)."""
        if self._known is None and self.host.loaded.is_set() and self.host.engine is not None:
            lm = self.host.engine.lm
            self._known = {
                "context_length": int(lm.context_length),
                "max_token_bytes": max_token_bytes(lm.tokenizer),
            }
        return None if self._known is None else {self.model: self._known}

    def _has_room(self, wait: float) -> bool:
        """True when the engine can start one more request; else waits up to `wait` (its
        model may still be loading)."""
        if not self.host.loaded.wait(wait):
            return False
        with self._lock:
            if len(self._inbox) + len(self._running) < self.host.engine.max_rows:
                return True
            self._lock.wait(wait)
            return False

    # --- the publisher thread --------------------------------------------------------------

    def _publish_loop(self) -> None:
        polled = 0.0
        while True:
            with self._lock:
                while not (self._events or self._ended or self._done):
                    if not self._running:
                        self._lock.wait()
                        continue
                    left = polled + CANCEL_POLL_SECONDS - time.monotonic()
                    if left <= 0 or not self._lock.wait(left):
                        break  # time to look for cancels
                events, self._events = self._events, []
                ended, self._ended = self._ended, []
                running: list[str] = []
                if self._running and time.monotonic() >= polled + CANCEL_POLL_SECONDS:
                    running, polled = list(self._running), time.monotonic()
                last = self._done and not events and not ended
            try:
                self._send(events, ended, running)
            except Exception as exc:  # Redis away: the API gives up on them by itself
                log.warning("relay publish: %r", exc)
            if last:
                return

    def _send(self, events: list[Any], ended: list[Taken], running: list[str]) -> None:
        lagging = self._out.publish(events) if events else set()
        for t in ended:
            self._out.finish(t)
            self._out.forget(t.request.id)
        gone = self._out.cancelled(running) if running else set()
        if lagging:
            # Its client stopped reading: dropped as if it had left, with an error event
            # that ends the stream should the client read on after all.
            with self._lock:
                for key in lagging:
                    held = self._running.get(key)
                    if held is not None and key not in gone:
                        failed = Failed(worker=self.wid, status=400, error=_LAGGING)
                        self._events.append((held.request, failed))
                gone |= lagging
        if gone:
            with self._lock:
                self._cancels |= gone
                for key in gone:
                    t = self._running.pop(key, None)  # type: ignore[arg-type]
                    if t is not None:
                        self._ended.append(t)
                self._lock.notify_all()

    def _queue(
        self,
        request: OnlineRequest,
        event: WorkerEvent | dict[str, Any],
        end: Taken | None = None,
    ) -> None:
        """An event for the publisher, sent at the engine's next step (`cancelled`): one
        wake-up a step, not one per event (each would take the GIL from the loop)."""
        if end is None:
            self._heard[request.id] = time.monotonic()
        else:
            self._heard.pop(request.id, None)
        with self._lock:
            self._events.append((request, event))
            if end is not None:
                self._ended.append(end)
                self._running.pop(request.id, None)

    def _send_queued(self) -> None:
        if self._events or self._ended:
            with self._lock:
                self._lock.notify_all()

    # --- the engine's feed (engine/requests/feed.py's LaneFeed), in the engine's thread ---

    def waiting(self) -> bool:
        return bool(self._inbox)

    def owns(self, key: Any) -> bool:
        return key in self.live

    def _prepare(self, r: OnlineRequest) -> EngineRequest | GenResult:
        """The request parsed and tokenized here, off the engine's thread; a failure of
        the preparer fails this request alone."""
        body = {k: v for k, v in r.body.items() if k not in _STREAM_FIELDS}
        line = GenRequest(r.id, body, stream=r.streamed, adapter=adapter_of(body, self.model))
        prepare = self.host.prepare
        if prepare is None:  # an embedding model's runner takes the line as it is
            return line  # type: ignore[return-value]
        try:
            return prepare(line)
        except Exception as exc:  # the preparer answers its own failures; not this taker's
            log.exception("preparing online request %s failed", r.id)
            return server_error(r.id, exc)

    def take(self) -> list[EngineRequest | GenResult]:
        with self._lock:
            taken = list(self._inbox)
            self._inbox.clear()
            for t, _ in taken:
                self._running[t.request.id] = t
        out = []
        for t, prepared in taken:
            self.live[t.request.id] = t
            out.append(prepared)
        if out:
            metrics.handed(self.model, len(out))
            metrics.ONLINE_IN_FLIGHT.labels(self.model).set(len(self.live))
        return out

    def started(self, key: Any, prompt_tokens: int) -> None:
        t = self.live.get(key)
        if t is not None:
            fp = self.host.engine.system_fingerprint
            event = Started(worker=self.wid, system_fingerprint=fp, prompt_tokens=prompt_tokens)
            self._queue(t.request, event)

    def emit(self, key: Any, deltas: list[ChoiceDelta]) -> None:
        t = self.live.get(key)
        if t is not None:
            # The engine built them in ChoiceDelta's shape: sent as they are (no model built
            # on the engine's thread, a step's worth per step).
            delta = {"worker": self.wid, "type": "delta", "choices": deltas}
            self._queue(t.request, delta)

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
            completion = result.completion
            if not is_embedding_body(completion):  # an embeddings list has neither
                chat = completion.get("object") == "chat.completion"
                rid = chat_id(r.id) if chat else r.id
                completion = {**completion, "id": rid, "created": r.created}
            event: WorkerEvent = Done(worker=self.wid, completion=completion)
        else:
            error = result.error or {"message": "generation failed", "type": "server_error"}
            event = Failed(worker=self.wid, status=result.status_code, error=error)
        self._queue(r, event, end=t)
        if not self.live:
            # No online request left to step for: no step may come to send this (a request
            # that ends at admission, echo scoring with max_tokens 0, has no step at all).
            self._send_queued()
        metrics.finished(self.model, [result])
        metrics.ONLINE_IN_FLIGHT.labels(self.model).set(len(self.live))

    def cancelled(self) -> set[Any]:
        """Once a step, first thing: the last step's events go out; ids in the engine that
        the API gave up leave it now, without events."""
        self._tick()
        self._send_queued()
        if not self._cancels:
            return set()
        with self._lock:
            gone, self._cancels = self._cancels, set()
        gone &= self.live.keys()
        for key in gone:
            del self.live[key]
            self._heard.pop(key, None)
        if gone:
            metrics.ONLINE_CANCELLED.labels(self.model).inc(len(gone))
            metrics.released(self.model, len(gone))
            metrics.ONLINE_IN_FLIGHT.labels(self.model).set(len(self.live))
        return gone

    def _tick(self) -> None:
        """A Tick for each request held that heard nothing for TICK_SECONDS (at most one
        look a TICK_SECONDS: this runs every step)."""
        now = time.monotonic()
        if now - self._ticked < TICK_SECONDS or not self.live:
            return
        self._ticked = now
        for key, t in self.live.items():
            if now - self._heard.get(key, 0.0) >= TICK_SECONDS:
                self._queue(t.request, Tick(worker=self.wid))

    def fail_all(self, exc: BaseException) -> None:
        """The engine's run failed: every request it held ends with a 500 (what failed is
        the worker's to log, not the clients' to read)."""
        for t in list(self.live.values()):
            failed = Failed(worker=self.wid, status=500, error=dict(_ENGINE_FAILED))
            self._queue(t.request, failed, end=t)
        metrics.released(self.model, len(self.live))
        self.live.clear()
        self._heard.clear()
        metrics.ONLINE_IN_FLIGHT.labels(self.model).set(0)
        self._send_queued()


def max_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the bytes of any one token's text: its vocabulary entry's length
    in UTF-8 (a byte-level entry spells each byte with one character of one or two bytes;
    a SentencePiece one spells a space as three, a raw byte as six: never fewer than the
    bytes they stand for). Special tokens are in the vocabulary too."""
    vocab = tokenizer.get_vocab()
    return max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1)


def start_pump(host: Host, settings: Settings) -> RelayPump:
    pump = RelayPump(host, settings)
    host.online = pump
    pump.start()
    return pump
