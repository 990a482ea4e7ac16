"""A lease's database work in a process of its own, beside the generation loop.

Claims, lease renewals, cancel checks and result writes run in a child process
(worker/lease_child/) with the same parts as the in-process path (its pipeline.py); the
loop only hands requests and results over a socket. In one process the claim and writer threads
hold the GIL while SQLAlchemy builds and runs their statements, and the loop waits for it
at its next torch call: on the 2-core host the service path's extra wall time equalled
those threads' CPU time (0.7 s per 2,000 lines). In a child, that work runs beside the
loop instead of between its steps.

A child serves one lease at a time and is kept for the next; a worker holds one per lease
it runs at once, so normally one. The embedded SQLite run keeps the threads (one file,
one process, Ctrl-C handled in-process: runs/interrupt.py).
"""

from __future__ import annotations

import logging
import select
import socket
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, cast

from sqlalchemy.exc import OperationalError

from batchwright.config import Settings
from batchwright.controlplane import budget
from batchwright.controlplane.dispatch import CeleryDispatcher, get_dispatcher
from batchwright.engine.requests.types import GenRequest, GenResult
from batchwright.worker import metrics
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
from batchwright.worker.lease_child.pipeline import Line, Prepare

log = logging.getLogger(__name__)

# Results go over in lots of this many, or at the loop's next step, whichever comes first.
SEND_EVERY = 32


def wanted(settings: Settings) -> bool:
    return settings.lease_process and settings.resolved_database_url().startswith("postgres")


class _Child:
    def __init__(self, settings: Settings) -> None:
        ours, theirs = socket.socketpair()
        fd = theirs.detach()
        self.settings = settings
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "batchwright.worker.lease_child", str(fd)], pass_fds=[fd]
        )
        socket.socket(fileno=fd).close()
        self.conn = Connection(ours.detach())
        # Asked a few times a step: Connection.poll builds a selector per call (3 % of the
        # loop's time with the demo model); one poll object answers in a system call.
        self._poller = select.poll()
        self._poller.register(self.conn.fileno(), select.POLLIN)

    def readable(self) -> bool:
        return bool(self._poller.poll(0))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.conn.close()  # end of file: the child exits
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_idle: list[_Child] = []
_idle_lock = threading.Lock()


def _acquire(settings: Settings) -> _Child:
    with _idle_lock:
        while _idle:
            child = _idle.pop()
            # Settings reloaded (tests, benches): the child read the old ones at its start.
            if child.settings is settings and child.alive():
                return child
            child.close()
    return _Child(settings)


def _give_back(child: _Child) -> None:
    with _idle_lock:
        _idle.append(child)


def _failure(failure: Failure) -> Exception:
    # Raised in the worker as the in-process path would have: a database error stays one
    # (Celery retries it; the budget counts it as a lost run, not the lines' fault).
    text = failure.text
    if failure.infrastructure:
        return OperationalError(f"lease process: {text}", None, ConnectionError(text))
    return RuntimeError(f"lease process: {text}")


def _record(counters: Counters) -> None:
    """The lease process's counters, into this process's metrics (the ones served)."""
    metrics.LEASE_RENEWALS.inc(counters.renewals)
    if counters.expired:
        metrics.LEASE_EXPIRIES.inc(counters.expired)
    for seconds in counters.write_seconds:
        metrics.RESULT_WRITE_SECONDS.observe(seconds)


class RemoteLease:
    """The worker's side: a request source (with `ready()`, engine/scheduling/intake.py), a result
    sink and the engine's cancel hook, all served by a lease process; the engine host
    (engine_host.py) runs it. `landed` is known once the lease closes."""

    # Its window is ordered (newcomers first): the engine reads it only a little ahead.
    orders_ahead = True

    def __init__(
        self,
        model: str,
        settings: Settings,
        stop: threading.Event,
        prepare: Prepare | None = None,
    ) -> None:
        self.model = model
        # The engine's preparer: the lines that come over are parsed and tokenized in a
        # thread of this side (the lease process has no model), not on the engine's.
        self.prepare = prepare
        self._preparing: deque[Future[list[tuple[Any, Line]]]] = deque()
        self._pool: ThreadPoolExecutor | None = None
        self.settings = settings
        self.stop = stop
        self.token = ""
        self.more_work = False
        self.landed = 0
        self.handed = 0
        self.received = 0
        # Requests sent ahead of the engine: a claim's worth, so that the lease process's
        # claims keep running (it hears of a newcomer batch while it hands lines over) and
        # the newcomer's lines reach this window, where they go first, within a step.
        self._window = max(2, settings.claim_batch_size)
        self._pending: deque[Line] = deque()
        # Lines of batches that started after this lease's first claim (a newcomer, whom the
        # lease process's claims put first) go before the window's lines of older ones.
        self._newcomers: deque[Line] = deque()
        self._older: set[Any] | None = None
        self._results: list[GenResult] = []
        self._cancelled: set[Any] = set()
        self._new_cancels: set[Any] = set()
        self._taken = 0
        self._unreported = 0
        self._ended = False
        self._stopping = False
        self._child: _Child | None = None

    # --- the engine's side ---------------------------------------------------------------

    def ready(self) -> int:
        self._pump(block=False)
        self._collect(wait=False)
        return len(self._newcomers) + len(self._pending)

    def at_end(self) -> bool:
        """No line left to hand over (worker/generation/engine_host.py asks while rows run)."""
        return self._ended and not (self._newcomers or self._pending or self._preparing)

    def __iter__(self) -> Iterator[Line]:
        while True:
            while not (self._newcomers or self._pending):
                if self._preparing:
                    self._collect(wait=True)
                    continue
                if self._ended:
                    return
                self._pump(block=True)
            req = (self._newcomers or self._pending).popleft()
            self._taken += 1
            if self._taken * 2 >= self._window:
                self._send(Credit(self._taken))
                self._taken = 0
            if req.key in self._cancelled:
                continue  # cancelled between its claim and the engine asking for it
            self.handed += 1
            self._unreported += 1  # to the metrics at the next pump, a step's at once
            yield req

    def cancelled(self) -> AbstractSet[Any]:
        """The engine's cancel hook, asked once a step: also when results go over."""
        self._pump(block=False)
        if not self._new_cancels:
            return frozenset()
        keys, self._new_cancels = frozenset(self._new_cancels), set()
        return keys

    def put(self, result: GenResult) -> None:
        self.received += 1
        self._results.append(result)
        if len(self._results) >= SEND_EVERY:
            self._flush()

    # --- the pipe ------------------------------------------------------------------------

    def _send(self, msg: ToChild) -> None:
        assert self._child is not None
        try:
            self._child.conn.send(msg)
        except OSError as exc:
            raise _failure(Failure(f"lease process gone ({exc!r})", True)) from exc

    def _recv(self) -> ToWorker:
        assert self._child is not None
        try:
            msg: ToWorker = self._child.conn.recv()
        except (EOFError, OSError) as exc:
            raise _failure(Failure(f"lease process gone ({exc!r})", True)) from exc
        return msg

    def _flush(self) -> None:
        if self._results:
            results, self._results = self._results, []
            self._send(Results(results))
            metrics.finished(self.model, results)

    def _pump(self, *, block: bool) -> None:
        """Send what is due; take in what the child sent (waiting for one if `block`)."""
        assert self._child is not None
        self._flush()
        if self.stop.is_set() and not self._stopping:
            self._stopping = True
            self._send(Stop())
        if self._unreported:
            metrics.handed(self.model, self._unreported)
            self._unreported = 0
        while block or self._child.readable():
            block = False
            self._handle(self._recv())

    def _handle(self, msg: ToWorker) -> None:
        match msg:
            case Requests(requests):
                if self._older is None:
                    self._older = {r.group for r in requests}
                if self.prepare is None:  # an engine that takes lines as they are
                    self._sort([(r.group, cast(Line, r)) for r in requests])
                else:
                    if self._pool is None:
                        self._pool = ThreadPoolExecutor(1, thread_name_prefix="prepare")
                    self._preparing.append(
                        self._pool.submit(self._prepared, requests, self.prepare)
                    )
            case End(more_work):
                self._ended, self.more_work = True, more_work
            case Cancelled(keys):
                self._cancelled |= keys
                self._new_cancels |= keys
            case Stats(counters):
                _record(counters)
            case Dispatch(task, args):
                get_dispatcher().send(task, *args)
            case Error(failure):
                raise _failure(failure)

    @staticmethod
    def _prepared(lines: list[GenRequest], prepare: Prepare) -> list[tuple[Any, Line]]:
        return [(line.group, prepare(line)) for line in lines]

    def _collect(self, *, wait: bool) -> None:
        """Lines prepared, in the order they came (waiting for the first if `wait`)."""
        while self._preparing and (wait or self._preparing[0].done()):
            wait = False
            self._sort(self._preparing.popleft().result())

    def _sort(self, lines: list[tuple[Any, Line]]) -> None:
        assert self._older is not None
        for group, line in lines:
            (self._pending if group in self._older else self._newcomers).append(line)

    # --- the lease -----------------------------------------------------------------------

    def __enter__(self) -> RemoteLease:
        self._child = _acquire(self.settings)
        try:
            relay = not isinstance(get_dispatcher(), CeleryDispatcher)
            self._send(Open(self.model, self._window, relay))
            msg = self._recv()
            while not isinstance(msg, Opened):
                self._handle(msg)
                msg = self._recv()
        except BaseException:
            self._child.close()
            raise
        self.token = msg.token
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, _: Any
    ) -> None:
        assert self._child is not None
        if self._pool is not None:  # lines not handed over yet go back with the lease
            self._pool.shutdown(wait=False, cancel_futures=True)
        child, error = self._child, None
        if exc is not None:
            error = Failure(repr(exc)[:500], budget.is_infrastructure(exc))
        failed: Failure | None = None
        try:
            self._flush()
            self._send(Close(error))
            msg = self._recv()
            while not isinstance(msg, Closed):
                if isinstance(msg, Error):
                    failed = msg.failure
                elif not isinstance(msg, Requests):
                    self._handle(msg)
                msg = self._recv()
        except BaseException:
            child.close()
            if exc is None:
                raise
            return
        _give_back(child)
        self.landed = msg.landed
        metrics.handed(self.model, self._unreported)
        self.more_work = self.more_work or msg.more_work
        if self.handed > self.received:
            metrics.released(self.model, self.handed - self.received)
        _record(msg.counters)
        if failed is not None and exc is None:
            raise _failure(failed)
