"""Leases on request rows: claim with SKIP LOCKED, keep alive, release on failure."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import orjson
from sqlalchemy import or_, select, update

from batchwright.config import Settings
from batchwright.db.models import Batch, BatchRequest
from batchwright.db.session import session_scope
from batchwright.engine.types import GenRequest

# A line that was in flight when runs failed twice may be what fails them: from then on it
# runs alone, so it cannot use up the attempts of the lines that happened to share its run.
SOLO_AFTER = 2


def is_out_of_memory(exc: BaseException | None) -> bool:
    # torch.cuda.OutOfMemoryError, matched by name: this module never imports torch.
    return type(exc).__name__ == "OutOfMemoryError"


class Lease:
    """One worker run's claim on rows of one model's in-progress batches."""

    def __init__(self, model: str, settings: Settings, stop: threading.Event) -> None:
        self.model = model
        self.settings = settings
        self.stop = stop
        # Random, not time-ordered: it only has to be unique; 30 chars fits lease_token (40).
        self.token = "lease_" + secrets.token_hex(12)
        self.deadline = time.monotonic() + settings.work_slice_seconds
        self.more_work = False  # stopped by the slice or a shutdown with rows still queued
        self._heartbeat_stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def claim(self, limit: int, *, suspects: bool = False) -> list[BatchRequest]:
        now = time.time()
        max_attempts = self.settings.max_attempts
        tries = (
            BatchRequest.attempts.between(SOLO_AFTER, max_attempts - 1)
            if suspects
            else BatchRequest.attempts < min(SOLO_AFTER, max_attempts)
        )
        with session_scope() as session:
            ids = list(
                session.scalars(
                    select(BatchRequest.id)
                    .join(Batch, Batch.id == BatchRequest.batch_id)
                    .where(
                        BatchRequest.state == "queued",
                        tries,
                        Batch.status == "in_progress",
                        Batch.model == self.model,
                        # Past its window a batch gets no new work: its finalize (queued
                        # behind this very task on a solo worker) expires what is left.
                        or_(Batch.expires_at.is_(None), Batch.expires_at > now),
                    )
                    # Within a batch, lines that start alike together (prefix_key).
                    .order_by(
                        Batch.created_at,
                        BatchRequest.batch_id,
                        BatchRequest.prefix_key,
                        BatchRequest.line_no,
                    )
                    .limit(limit)
                    .with_for_update(skip_locked=True, of=BatchRequest)
                )
            )
            if not ids:
                return []
            session.execute(
                update(BatchRequest)
                .where(BatchRequest.id.in_(ids))
                .values(
                    state="running",
                    lease_token=self.token,
                    lease_expires_at=now + self.settings.lease_seconds,
                    attempts=BatchRequest.attempts + 1,
                )
            )
            rows = list(
                session.scalars(
                    select(BatchRequest)
                    .where(BatchRequest.id.in_(ids))
                    .order_by(BatchRequest.batch_id, BatchRequest.prefix_key, BatchRequest.line_no)
                )
            )
        return rows

    def requests(self) -> Iterator[GenRequest]:
        """Rows for the engine, claimed a few at a time, only as the engine asks."""
        suspect = self.claim(1, suspects=True)
        if suspect:
            self.more_work = True  # this run is the suspect's alone; a follow-up does the rest
            yield from self._requests(suspect)
            return
        while True:
            if self.stop.is_set() or time.monotonic() >= self.deadline:
                self.more_work = True
                return
            rows = self.claim(self.settings.claim_batch_size)
            if not rows:
                return
            yield from self._requests(rows)

    @staticmethod
    def _requests(rows: list[BatchRequest]) -> Iterator[GenRequest]:
        for row in rows:
            body: dict[str, Any] = orjson.loads(row.body)
            yield GenRequest(key=(row.id, row.batch_id), body=body)

    def _renew(self) -> None:
        with session_scope() as session:
            session.execute(
                update(BatchRequest)
                .where(BatchRequest.lease_token == self.token, BatchRequest.state == "running")
                .values(lease_expires_at=time.time() + self.settings.lease_seconds)
            )

    def _beat(self) -> None:
        interval = max(self.settings.lease_seconds / 3, 0.5)
        while not self._heartbeat_stop.wait(interval):
            try:
                self._renew()
            except Exception:  # a dropped connection: the next beat retries
                continue

    def __enter__(self) -> Lease:
        self._heartbeat = threading.Thread(target=self._beat, daemon=True, name="lease-beat")
        self._heartbeat.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._heartbeat_stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        if exc[0] is not None:
            error = exc[1] if isinstance(exc[1], BaseException) else None
            # Out of memory is our batch size, not the lines' fault: their attempt is refunded.
            self.release(f"Worker error: {error!r}"[:500], refund=is_out_of_memory(error))
        else:
            # Claimed but never finished (the engine stopped pulling early): not tried, so
            # back to the queue now rather than after the lease runs out.
            self.release(None, refund=True)

    def release(self, reason: str | None, *, refund: bool = False) -> None:
        """Give the rows this lease still holds back to the queue."""
        values: dict[str, object] = {
            "state": "queued",
            "lease_token": None,
            "lease_expires_at": None,
            "attempts": BatchRequest.attempts - (1 if refund else 0),
        }
        if reason is not None:
            values["error"] = orjson.dumps(
                {"message": reason, "type": "server_error", "param": None, "code": "server_error"}
            ).decode()
        with session_scope() as session:
            session.execute(
                update(BatchRequest)
                .where(BatchRequest.lease_token == self.token, BatchRequest.state == "running")
                .values(**values)
            )
