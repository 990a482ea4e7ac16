"""Keep the generation loop off the database: claims read ahead, results written behind.

ReadAhead runs a lease's claims in a thread a bounded number of requests ahead of the
engine; ResultWriter writes results from a thread through a bounded queue (the loop blocks
only when the queue is full). Both keep the lease rules: a result lands only while this
lease still holds its line (results.write_results), and lines claimed but never handed to
the engine go back to the queue when the lease closes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from sqlalchemy.exc import DBAPIError, OperationalError

from batchwright.db.session import session_scope
from batchwright.engine.types import GenRequest, GenResult
from batchwright.worker import metrics
from batchwright.worker.results import write_results

log = logging.getLogger(__name__)

# A write waits for FLUSH_EVERY results (or FLUSH_SECONDS) and takes whatever else is
# queued, up to FLUSH_MAX: when writes fall behind they grow, so fewer statements per line
# catch up instead of a backlog delaying every later result.
FLUSH_EVERY = 32
FLUSH_MAX = 512
FLUSH_SECONDS = 0.2
_END = object()


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class ReadAhead:
    """Iterates `source` (a lease's claims) in a thread, at most `depth` requests ahead."""

    def __init__(self, source: Iterator[GenRequest], model: str, depth: int) -> None:
        self.source = source
        self.model = model
        self.handed = 0
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, daemon=True, name="claim-ahead")
        self._started = False

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _fill(self) -> None:
        try:
            for request in self.source:
                if not self._put(request):
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
        """Requests the engine can take now without waiting (engine/intake.py)."""
        return self._queue.qsize()

    def __iter__(self) -> Iterator[GenRequest]:
        if not self._started:
            self._started = True
            self._thread.start()
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.exc
            self.handed += 1
            metrics.handed(self.model, 1)
            yield item

    def close(self) -> None:
        self._stop.set()
        if self._started:
            self._thread.join(timeout=30)


class ResultWriter:
    """Writes results for one lease from a thread; `put` blocks only when it falls behind."""

    def __init__(self, token: str, model: str, size: int, retry_seconds: float) -> None:
        self.token = token
        self.model = model
        self.retry_seconds = retry_seconds
        self.landed = 0
        self.received = 0
        self.error: BaseException | None = None
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, size))
        self._thread = threading.Thread(target=self._drain, daemon=True, name="result-writer")

    def __enter__(self) -> ResultWriter:
        self._thread.start()
        return self

    def put(self, result: GenResult) -> None:
        if self.error is not None:
            raise self.error
        self.received += 1
        self._queue.put(result)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Results already generated are good whatever stopped the loop: write them first.
        self._queue.put(_END)
        self._thread.join()
        if self.error is not None and exc is None:
            raise self.error

    def _drain(self) -> None:
        done = False
        while not done:
            first = self._queue.get()
            if first is _END:
                return
            buffer: list[GenResult] = [first]
            deadline = time.monotonic() + FLUSH_SECONDS
            while len(buffer) < FLUSH_MAX:
                try:
                    if len(buffer) < FLUSH_EVERY:
                        item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                    else:
                        item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _END:
                    done = True
                    break
                buffer.append(item)
            if self.error is None:
                try:
                    self._write(buffer)
                except BaseException as exc:
                    # Stop writing; the loop sees it at its next put. The lines stay with
                    # the lease (released when it closes) or come back when it expires.
                    self.error = exc
            metrics.finished(self.model, buffer)

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
        metrics.RESULT_WRITE_SECONDS.observe(time.perf_counter() - start)
        self.landed += landed
        if landed < len(buffer):
            metrics.LEASE_EXPIRIES.inc(len(buffer) - landed)


def generate(
    engine: Any, lease: Any, model: str, settings: Any, cancelled: Any | None = None
) -> int:
    """Run `engine` on the lease's lines; returns how many results landed. `cancelled`:
    the engine's cancel hook (Engine.run(requests, cancelled=...)), passed through."""
    # The engine's window (engine/intake.py) hides a claim's latency; lines queued here
    # are ahead of a newcomer's (claims.py), so only a few wait here.
    feed = ReadAhead(lease.requests(), model, max(1, settings.claim_batch_size // 8))
    writer = ResultWriter(lease.token, model, settings.result_queue_size, settings.lease_seconds)
    try:
        with writer:
            hook = {} if cancelled is None else {"cancelled": cancelled}
            for result in engine.run(feed, **hook):
                writer.put(result)
    finally:
        feed.close()
        if feed.handed > writer.received:
            metrics.released(model, feed.handed - writer.received)
    return writer.landed
