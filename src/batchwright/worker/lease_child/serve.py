"""The lease child's main (the generation process's side: generation/lease_process.py).

`python -m batchwright.worker.lease_child FD`: FD is its end of a socket pair with the
worker. It serves one lease at a time with the in-process path's own parts (Lease,
ReadAhead, ResultWriter), the pipe standing in for the engine, and waits for the next.

The messages, either way, are messages.py's.

End of file means the worker died: this exits at once and leaves its lines to the lease's
expiry, as a worker death did before (the sweeper re-queues them, charged to no line).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from batchwright.config import get_settings
from batchwright.controlplane import budget
from batchwright.controlplane.dispatch import (
    FINALIZE,
    CeleryDispatcher,
    get_dispatcher,
    set_dispatcher,
)
from batchwright.worker.lease_child.claims import Lease
from batchwright.worker.lease_child.messages import (
    Cancelled,
    Close,
    Closed,
    Counters,
    Credit,
    Dispatch,
    End,
    Error,
    Failure,
    Open,
    Opened,
    Requests,
    Results,
    Stats,
    Stop,
    ToChild,
    ToWorker,
)
from batchwright.worker.lease_child.pipeline import ReadAhead, ResultWriter

log = logging.getLogger("batchwright.lease_process")


class _Pipe:
    """The connection, sent to from two threads (requests and cancels) and the main one."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, msg: ToWorker) -> None:
        with self._lock:
            self.conn.send(msg)

    def recv(self) -> ToChild:
        try:
            msg: ToChild = self.conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # the worker is gone: so is this lease (see the module's note)
        return msg


class _PipeDispatcher:
    """The child's messages (a batch's finalize) for a worker whose dispatcher is in its
    own process (the embedded run, in-process tests): they go over the pipe to it."""

    def __init__(self, pipe: _Pipe) -> None:
        self.pipe = pipe

    def send(self, name: str, *args: Any) -> None:
        self.pipe.send(Dispatch(name, args))


class _Credit:
    """Requests the worker will take: it sends more as the engine takes them."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._closed = False
        self._cond = threading.Condition()

    def add(self, n: int) -> None:
        with self._cond:
            self._n += n
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def take(self, most: int, *, wait: bool = True) -> int:
        """Take up to `most` of the credit, waiting for some if `wait` (0: closed)."""
        with self._cond:
            while wait and self._n == 0 and not self._closed:
                self._cond.wait()
            if self._closed:
                return 0
            n = min(most, self._n)
            self._n -= n
            return n


class _Report:
    """The lease's counters for the worker's metrics (its registry is the one served), sent
    as they grow: at most once a second while results come in, and the rest at close."""

    EVERY = 1.0

    def __init__(self, lease: Lease, writer: ResultWriter) -> None:
        self.lease, self.writer = lease, writer
        self._renewals = self._expired = self._writes = 0
        self._last = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.EVERY

    def delta(self) -> Counters:
        self._last = time.monotonic()
        renewals, expired = self.lease.renewals, self.writer.expired
        timings = self.writer.timings[self._writes :]
        out = Counters(renewals - self._renewals, expired - self._expired, timings)
        self._renewals, self._expired = renewals, expired
        self._writes += len(timings)
        return out


def _send_requests(pipe: _Pipe, feed: ReadAhead, lease: Lease, credit: _Credit) -> None:
    try:
        it = iter(feed)
        while credit.take(1):
            batch = [next(it, None)]
            # What the read-ahead holds now goes in the same message, without waiting.
            for _ in range(credit.take(feed.ready(), wait=False) if batch[0] else 0):
                batch.append(next(it, None))
            requests = [r for r in batch if r is not None]
            if requests:
                pipe.send(Requests(requests))
            if len(requests) < len(batch):
                pipe.send(End(lease.more_work))
                return
    except BaseException as exc:
        log.warning("claims failed: %r", exc)
        pipe.send(Error(Failure(repr(exc)[:500], budget.is_infrastructure(exc))))


def _serve(pipe: _Pipe, model: str, window: int) -> None:
    settings = get_settings()
    stop = threading.Event()
    error: Failure | None = None
    with Lease(model, settings, stop) as lease:

        def cancelled(batch_id: str) -> None:
            pipe.send(Cancelled(lease.cancels.drain()))
            get_dispatcher().send(FINALIZE, batch_id)

        lease.cancels.on_batch = cancelled
        # Shallow: lines queued here are ahead of a newcomer batch's (claims.py); in the
        # worker's window (generation/lease_process.py, a claim's worth) a newcomer's go first.
        writer = ResultWriter(
            lease.token, model, settings.result_queue_size, settings.lease_seconds
        )
        feed = ReadAhead(
            lease.requests(), model, max(1, settings.claim_batch_size // 16), writer.handed
        )
        credit = _Credit(window)
        sender = threading.Thread(
            target=_send_requests, args=(pipe, feed, lease, credit), daemon=True, name="requests"
        )
        report = _Report(lease, writer)
        pipe.send(Opened(lease.token))
        try:
            with writer:
                sender.start()
                while True:
                    match pipe.recv():
                        case Results(results):
                            for result in results:
                                writer.put(result)
                            if report.due():
                                pipe.send(Stats(report.delta()))
                        case Credit(n):
                            credit.add(n)
                        case Stop():
                            stop.set()
                        case Close(error):
                            break
        finally:
            stop.set()
            credit.close()
            feed.close()
            sender.join(timeout=30)
        if error is not None:
            # The run failed in the worker; the results it had sent are written above.
            lease.release(f"Worker error: {error.text}"[:500], lost=error.infrastructure)
        # Leaving the lease gives back what was claimed and never finished (refunded).
    pipe.send(Closed(writer.landed, lease.more_work, report.delta()))


def main() -> None:
    # Signals are the worker's to act on; it tells this process what to do.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s lease-process %(message)s")
    pipe = _Pipe(Connection(int(sys.argv[1])))
    while True:
        match pipe.recv():
            case Open(model, window, relay):
                set_dispatcher(_PipeDispatcher(pipe) if relay else CeleryDispatcher())
                try:
                    _serve(pipe, model, window)
                except BaseException as exc:  # the lease could not open or close: say so
                    log.warning("lease failed: %r", exc)
                    pipe.send(Error(Failure(repr(exc)[:500], budget.is_infrastructure(exc))))
            case Close():  # after an error above: the lease is closed already
                pipe.send(Closed(0, False, Counters()))
