"""Keep the generation loop off the database: claims read ahead, results written behind.

ReadAhead runs a lease's claims in a thread a bounded number of requests ahead of the
engine; ResultWriter writes results from a thread through a bounded queue (the loop blocks
only when the queue is full). Both keep the lease rules: a result lands only while this
lease still holds its line (results.write_results), and lines claimed but never handed to
the engine go back to the queue when the lease closes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterator
from types import TracebackType
from typing import Any

from sqlalchemy.exc import DBAPIError, OperationalError

from batchwright.db.session import session_scope
from batchwright.engine.requests.request import EngineRequest
from batchwright.engine.requests.types import GenRequest, GenResult
from batchwright.worker import metrics
from batchwright.worker.lease_child.results import write_results

# A line prepared for the engine (serving/prepare.py): a request, or its refusal.
Line = EngineRequest | GenResult
Prepare = Callable[[GenRequest], Line]

log = logging.getLogger(__name__)

# A write waits for FLUSH_EVERY results (or half the queue, or FLUSH_SECONDS) and takes
# whatever else is queued, up to FLUSH_MAX: when writes fall behind they grow, so fewer
# statements per line catch up instead of a backlog delaying every later result. A write's
# fixed cost (six statements and a commit: about 4.5 ms of the writer's CPU, against 45 us
# per line, on a 2-core host) is three quarters of a 32-line write and under half of a
# 128-line one; at CPU speeds FLUSH_SECONDS comes first (about 90 lines).
FLUSH_EVERY = 128
FLUSH_MAX = 512
FLUSH_SECONDS = 0.2
# How long a write whose results include a batch's last lines in the engine waits for more:
# with an engine that answers a line at a time (bench/control_plane.py's stub), every result
# is one, and at once would mean a transaction per result (0.04 a line against 0.024).
URGENT_SECONDS = 0.02
_END = object()


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class ReadAhead:
    """Iterates `source` (a lease's claims) in a thread, at most `depth` requests ahead.

    The thread tops the buffer up only once the engine has taken half of it: every wake-up
    of a helper thread takes the GIL from the generation loop at its next torch call (the
    loop lets go of it in each one), so one per line handed over cost the loop more than
    the claims' own work."""

    def __init__(
        self,
        source: Iterator[GenRequest],
        model: str,
        depth: int,
        on_hand: Callable[[Line | GenRequest], None] | None = None,
        prepare: Prepare | None = None,
    ) -> None:
        self.source = source
        self.model = model
        # The engine's preparer (serving/prepare.py): lines are parsed and
        # tokenized here, in this thread, not on the engine's. None: lines pass as they are
        # (the lease process, whose worker prepares them).
        self.prepare = prepare
        self.handed = 0
        self._on_hand = on_hand
        self._depth = max(1, depth)
        self._low = self._depth // 2
        self._items: deque[Any] = deque()
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._low_water = threading.Condition(self._lock)
        self._stop = False
        self._thread = threading.Thread(target=self._fill, daemon=True, name="claim-ahead")
        self._started = False

    def _put(self, item: object) -> bool:
        with self._lock:
            if len(self._items) >= self._depth:
                while len(self._items) > self._low and not self._stop:
                    self._low_water.wait()
            if self._stop:
                return False
            self._items.append(item)
            if len(self._items) == 1:
                self._not_empty.notify()
        return True

    def _fill(self) -> None:
        prepare = self.prepare
        try:
            for request in self.source:
                if not self._put(request if prepare is None else prepare(request)):
                    break
            else:
                self._put(_END)
        except BaseException as exc:
            self._put(_Failed(exc))
        finally:
            close = getattr(self.source, "close", None)
            if close is not None:
                close()  # the generator runs (and ends) in this thread

    def ready(self) -> int:
        """Requests the engine can take now without waiting (engine/scheduling/intake.py)."""
        return len(self._items)

    def at_end(self) -> bool:
        """The next item is the end (or a failure): worker/generation/engine_host.py asks."""
        with self._lock:
            return bool(self._items) and (
                self._items[0] is _END or isinstance(self._items[0], _Failed)
            )

    def __iter__(self) -> Iterator[Any]:
        if not self._started:
            self._started = True
            self._thread.start()
        while True:
            with self._lock:
                while not self._items and not self._stop:
                    self._not_empty.wait()
                if not self._items:
                    return  # closed from another thread (serve.py)
                item = self._items.popleft()
                if len(self._items) == self._low:
                    self._low_water.notify()
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.exc
            self.handed += 1
            metrics.handed(self.model, 1)
            if self._on_hand is not None:
                self._on_hand(item)
            yield item

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._low_water.notify()
            self._not_empty.notify()
        if self._started:
            self._thread.join(timeout=30)


class ResultWriter:
    """Writes results for one lease from a thread; `put` blocks only when it falls behind.

    The thread is woken when a write's worth has gathered (or the first result of one has
    waited FLUSH_SECONDS), not for every result: see ReadAhead on what a wake-up costs.
    Results that leave a batch with no line in this lease's engine (`handed` tells it what
    went there) are written within URGENT_SECONDS: often a batch's last lines, which would
    otherwise wait for a write's worth of a big batch's results (up to FLUSH_SECONDS)."""

    def __init__(self, token: str, model: str, size: int, retry_seconds: float) -> None:
        self.token = token
        self.model = model
        self.retry_seconds = retry_seconds
        self.landed = 0
        self.received = 0
        self.expired = 0  # results whose lines this lease no longer held
        self.timings: list[float] = []  # seconds per write (the lease process reports them)
        self.error: BaseException | None = None
        self._size = max(1, size)
        self._every = max(1, min(FLUSH_EVERY, self._size // 2))
        self._items: deque[GenResult] = deque()
        self._out: Counter[Hashable] = Counter()  # lines in the engine, by batch
        self._urgent = False
        self._ended = False
        self._lock = threading.Lock()
        self._gathered = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._drain, daemon=True, name="result-writer")

    def __enter__(self) -> ResultWriter:
        self._thread.start()
        return self

    def handed(self, request: Line | GenRequest) -> None:
        """`request` went to the engine (ReadAhead's on_hand)."""
        with self._lock:
            self._out[request.key[1]] += 1

    def put(self, result: GenResult) -> None:
        if self.error is not None:
            raise self.error
        self.received += 1
        batch = result.key[1]
        with self._lock:
            while len(self._items) >= self._size:
                self._not_full.wait()
            self._items.append(result)
            if batch in self._out:
                self._out[batch] -= 1
                if self._out[batch] <= 0:
                    del self._out[batch]
                    self._urgent = True
            if self._urgent or len(self._items) in (1, self._every):
                self._gathered.notify()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Results already generated are good whatever stopped the loop: write them first.
        with self._lock:
            self._ended = True
            self._gathered.notify()
        self._thread.join()
        if self.error is not None and exc is None:
            raise self.error

    def _take(self) -> tuple[list[GenResult], bool]:
        """The next write's results (waiting for them), and whether they are the last."""
        with self._lock:
            while not self._items and not self._ended:
                self._gathered.wait()
            first = time.monotonic()
            while len(self._items) < self._every and not self._ended:
                due = first + (URGENT_SECONDS if self._urgent else FLUSH_SECONDS)
                left = due - time.monotonic()
                if left <= 0:
                    break
                self._gathered.wait(left)
            self._urgent = False
            n = min(len(self._items), FLUSH_MAX)
            buffer = [self._items.popleft() for _ in range(n)]
            self._not_full.notify_all()
            return buffer, self._ended and not self._items

    def _drain(self) -> None:
        while True:
            buffer, last = self._take()
            if buffer and self.error is None:
                try:
                    self._write(buffer)
                except BaseException as exc:
                    # Stop writing; the loop sees it at its next put. The lines stay with
                    # the lease (released when it closes) or come back when it expires.
                    self.error = exc
            if buffer:
                metrics.finished(self.model, buffer)
            if last:
                return

    def _write(self, buffer: list[GenResult]) -> None:
        """One transaction; a dropped connection or a restarting database is retried for up
        to `retry_seconds` (the lease keeps the lines meanwhile) while the loop runs on."""
        delay, give_up = 0.2, time.monotonic() + self.retry_seconds
        while True:
            start = time.perf_counter()
            try:
                with session_scope() as session:
                    landed = write_results(session, self.token, buffer)
                break
            except (OperationalError, DBAPIError) as exc:
                if time.monotonic() + delay > give_up:
                    raise
                log.warning("result write failed (%r); retrying in %.1fs", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        self.timings.append(time.perf_counter() - start)
        metrics.RESULT_WRITE_SECONDS.observe(self.timings[-1])
        self.landed += landed
        if landed < len(buffer):
            self.expired += len(buffer) - landed
            metrics.LEASE_EXPIRIES.inc(len(buffer) - landed)
