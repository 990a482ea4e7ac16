"""Usage rows of online requests, written in batches by a thread of the API process, off
the request path: a request only appends its row to a bounded buffer.

The thread writes whatever gathered every `online_usage_flush_seconds` (or at once when a
batch's worth is waiting) in one INSERT. While the database is away rows wait in the
buffer and the writes are retried; past `online_usage_buffer` rows the newest are
dropped and counted (`batchwright_online_usage_rows_dropped_total`): accounting must not
hold up the requests. Shutdown writes what is left.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from sqlalchemy import insert
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from batchwright.db.models import OnlineUsage
from batchwright.db.session import session_scope
from batchwright.online import metrics

log = logging.getLogger(__name__)

_BATCH = 500


class UsageWriter:
    def __init__(self, capacity: int, flush_seconds: float) -> None:
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=max(1, capacity))
        self._flush_seconds = flush_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="online-usage", daemon=True)
        self._held: list[dict[str, Any]] = []

    def start(self) -> None:
        self._thread.start()

    def record(self, row: dict[str, Any]) -> None:
        try:
            self._queue.put_nowait(row)
        except queue.Full:
            metrics.USAGE_DROPPED.inc()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            busy = self._held or self._queue.qsize() >= _BATCH
            stopping = self._stop.wait(0 if busy else self._flush_seconds)
            self._gather()
            if self._held:
                try:
                    self._write()
                except IntegrityError:
                    self._write_one_by_one()
                except SQLAlchemyError as exc:
                    log.warning("usage rows not written yet (%d held): %r", len(self._held), exc)
                    if stopping:
                        return
                    self._stop.wait(min(5.0, self._flush_seconds * 4))
                    continue
            if stopping and self._queue.empty():
                return

    def _gather(self) -> None:
        while len(self._held) < _BATCH:
            try:
                self._held.append(self._queue.get_nowait())
            except queue.Empty:
                return

    def _write(self) -> None:
        started = time.perf_counter()
        with session_scope() as session:
            session.execute(insert(OnlineUsage), self._held)
        metrics.USAGE_WRITE_SECONDS.observe(time.perf_counter() - started)
        self._held = []

    def _write_one_by_one(self) -> None:
        """A row the table refuses (its project deleted meanwhile) must not hold up the rest."""
        for row in self._held:
            try:
                with session_scope() as session:
                    session.execute(insert(OnlineUsage), [row])
            except IntegrityError as exc:
                metrics.USAGE_DROPPED.inc()
                log.warning("usage row %s dropped: %s", row.get("id"), str(exc).splitlines()[0])
        self._held = []
