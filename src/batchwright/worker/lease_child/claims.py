"""Leases on request rows: claim with SKIP LOCKED, keep alive, release on failure."""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, NamedTuple

import orjson
from sqlalchemy import bindparam, select, update

from batchwright import catalog
from batchwright.config import Settings
from batchwright.controlplane import budget, newcomers
from batchwright.controlplane.budget import is_out_of_memory
from batchwright.db.models import Batch, BatchRequest
from batchwright.db.session import session_scope
from batchwright.engine.requests.types import GenRequest
from batchwright.worker import metrics
from batchwright.worker.adapters import adapter_of
from batchwright.worker.lease_child import fairshare
from batchwright.worker.lease_child.cancels import CancelWatch

__all__ = ["Claimed", "Lease", "is_out_of_memory"]


class Claimed(NamedTuple):
    """A claimed line, as much of it as the engine needs."""

    id: int
    batch_id: str
    line_no: int
    body: str


# The columns the engine needs come back with the update (no ORM objects: building them
# cost more of the worker's CPU than the claim's SQL). Built once, as are fairshare.py's.
_CLAIM = (
    update(BatchRequest)
    .where(BatchRequest.id.in_(bindparam("ids", expanding=True)))
    .values(
        state="running",
        lease_token=bindparam("token"),
        lease_expires_at=bindparam("expires"),
        attempts=BatchRequest.attempts + 1,
    )
    .returning(
        BatchRequest.id,
        BatchRequest.batch_id,
        BatchRequest.prefix_key,
        BatchRequest.line_no,
        BatchRequest.body,
    )
)


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
        self.renewals = 0
        self._heartbeat_stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.cancels = CancelWatch(self.token)
        self.cancelled = self.cancels.drain  # the engine's cancel hook
        # A run of one line: its failure is that line's own (controlplane/budget.py).
        self.alone = False
        self.claimed = 0

    def claim(self, limit: int, *, suspects: bool = False) -> list[Claimed]:
        with session_scope() as session:
            ids = fairshare.pick(session, self.model, limit, suspects=suspects)
            if not ids:
                return []
            expires = time.time() + self.settings.lease_seconds
            returned = (
                session.connection()
                .execute(_CLAIM, {"ids": ids, "token": self.token, "expires": expires})
                .all()
            )
        # A batch's lines grouped by prefix (issue 14), in file order within a prefix.
        self.claimed += len(returned)
        claimed = sorted(
            returned, key=lambda r: (r.batch_id, r.prefix_key is None, r.prefix_key, r.line_no)
        )
        return [Claimed(r.id, r.batch_id, r.line_no, r.body) for r in claimed]

    def requests(self) -> Iterator[GenRequest]:
        """Rows for the engine, claimed a few at a time, only as the engine asks."""
        suspect = self.claim(1, suspects=True)
        if suspect:
            self.more_work = True  # this run is the suspect's alone; a follow-up does the rest
            self.alone = True
            yield from self._requests(suspect)
            return
        seen: set[str] = set()  # batches in progress when this lease last looked
        listener = newcomers.Listener(self.model, self.settings)
        try:
            claimed = False
            while True:
                # A slice claims once whatever its length: every slice makes progress.
                if self.stop.is_set() or (claimed and time.monotonic() >= self.deadline):
                    self.more_work = True
                    return
                claimed = True
                rows = deque(self.claim(self.settings.claim_batch_size))
                if not rows:
                    return
                seen.update(r.batch_id for r in rows)
                while rows:
                    yield from self._requests([rows.popleft()])
                    if not listener.heard():
                        continue
                    # A batch that started since (a small one of another team, say) claims
                    # now and goes first, instead of after the rest of this claim.
                    started = self._started_since(seen)
                    if started:
                        extra = self.claim(self.settings.claim_batch_size)
                        extra.sort(key=lambda r: r.batch_id not in started)
                        rows.extendleft(reversed(extra))
        finally:
            listener.close()

    def _started_since(self, seen: set[str]) -> set[str]:
        """Batches of this model in progress now that were not at the last look."""
        with session_scope() as session:
            now = set(
                session.scalars(
                    select(Batch.id).where(
                        Batch.model.in_(catalog.family(session, self.model)),
                        Batch.status == "in_progress",
                    )
                )
            )
        started = now - seen
        seen.update(now)
        return started

    def _requests(self, rows: list[Claimed]) -> Iterator[GenRequest]:
        for row in rows:
            if (row.id, row.batch_id) in self.cancels:
                continue  # cancelled between its claim and the engine asking for it
            body: dict[str, Any] = orjson.loads(row.body)
            yield GenRequest(
                key=(row.id, row.batch_id),
                body=body,
                group=row.batch_id,
                adapter=adapter_of(body, self.model),
            )

    def _renew(self) -> None:
        with session_scope() as session:
            session.execute(
                update(BatchRequest)
                .where(BatchRequest.lease_token == self.token, BatchRequest.state == "running")
                .values(lease_expires_at=time.time() + self.settings.lease_seconds)
            )

    def _beat(self) -> None:
        interval = max(self.settings.lease_seconds / 3, 0.5)
        tick = min(interval, max(self.settings.cancel_poll_seconds, 0.1))
        renewed = time.monotonic()
        while not self._heartbeat_stop.wait(tick):
            try:
                if time.monotonic() - renewed >= interval:
                    self._renew()
                    self.renewals += 1
                    metrics.LEASE_RENEWALS.inc()
                    renewed = time.monotonic()
                self.cancels.poll()
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
            # Out of memory, a database or broker error: not the lines' doing
            # (controlplane/budget.py).
            lost = budget.is_infrastructure(error)
            self.release(f"Worker error: {error!r}"[:500], lost=lost)
        else:
            # Claimed but never finished (the engine stopped pulling early): not tried, so
            # back to the queue now rather than after the lease runs out.
            self.release(None, refund=True)

    def release(self, reason: str | None, *, refund: bool = False, lost: bool = False) -> None:
        """Give the rows this lease still holds back to the queue (`lost`: the run was lost
        to the infrastructure; a failure of a run of several lines is not charged to them
        either: both are counted apart from the lines' own attempts, controlplane/budget.py)."""
        values: dict[str, object] = {
            "state": "queued",
            "lease_token": None,
            "lease_expires_at": None,
            "attempts": BatchRequest.attempts - (1 if refund else 0),
        }
        if lost:
            values.update(budget.LOST_RUN)
        elif reason is not None and not (self.alone or self.claimed == 1):
            values.update(budget.SHARED_RUN)
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
