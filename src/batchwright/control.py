"""Control work: validate a batch, finalize it, sweep what crashes left behind.

Celery's control tasks (tasks.py) and the embedded run (runs/worker.py) call these; they
compose the services (batches, files, webhooks) and never touch the engine.
"""

from __future__ import annotations

import time

import orjson
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from batchwright import catalog
from batchwright.batches import lifecycle, redrive
from batchwright.config import Settings, get_settings
from batchwright.controlplane import budget, routing
from batchwright.controlplane.dispatch import FINALIZE, VALIDATE, get_dispatcher
from batchwright.db.models import Batch, BatchRequest
from batchwright.db.session import session_scope
from batchwright.files import purge
from batchwright.registry import Registry
from batchwright.webhooks import outbox


def validate_batch(batch_id: str, registry: Registry | None = None) -> None:
    settings = get_settings()

    def run() -> None:
        with session_scope() as session:
            # A repeat (the sweeper's re-send, a redelivery) of a batch that moved on: no
            # wait for its row, which a result write of the batch may hold. A batch never
            # goes back to validating, so the unlocked read is enough to skip.
            if session.scalar(select(Batch.status).where(Batch.id == batch_id)) != "validating":
                return
            batch = lifecycle.lock(session, batch_id)
            if batch is not None:
                lifecycle.validate(
                    session, batch, registry or catalog.registry(session, settings), settings
                )

    redrive.guarded("validation", batch_id, settings, run)


def finalize_batch(batch_id: str) -> None:
    settings = get_settings()

    def run() -> None:
        with session_scope() as session:
            batch = lifecycle.lock(session, batch_id)
            if batch is not None:
                lifecycle.finalize(session, batch, settings)

    redrive.guarded("finalization", batch_id, settings, run)


def _fail_exhausted(session: Session, settings: Settings) -> int:
    """Lines out of either budget go to the error file with their last error."""
    exhausted = (BatchRequest.state == "queued", budget.exhausted(settings))
    failed = 0
    for batch_id in session.scalars(select(BatchRequest.batch_id).where(*exhausted).distinct()):
        # The batch first, then its lines: the lock order finalize and result writes use.
        if lifecycle.lock(session, batch_id) is None:
            continue
        rows = list(
            session.scalars(
                select(BatchRequest)
                .where(BatchRequest.batch_id == batch_id, *exhausted)
                .with_for_update()
            )
        )
        for row in rows:
            reason = orjson.loads(row.error)["message"] if row.error else "unknown error"
            row.state, row.status_code = "failed", 500
            row.error = orjson.dumps(budget.final_error(row, reason, settings)).decode()
        session.execute(
            update(Batch).where(Batch.id == batch_id).values(failed=Batch.failed + len(rows))
        )
        failed += len(rows)
    return failed


def sweep() -> dict[str, int]:
    """Re-drive what a crash, a lost message or a dead worker left behind."""
    settings = get_settings()
    now = time.time()
    stats = {"requeued": 0, "exhausted": 0, "batches": 0}
    dispatcher = get_dispatcher()
    with session_scope() as session:
        # Lines a frozen worker holds locked mid-transaction are skipped, not waited for
        # (that wait held every other re-drive): the next sweep takes them once its
        # transaction ends, which a killed worker's connection does at once.
        lapsed = (
            select(BatchRequest.id)
            .where(BatchRequest.state == "running", BatchRequest.lease_expires_at < now)
            .with_for_update(skip_locked=True)
        )
        stats["requeued"] = session.execute(
            update(BatchRequest)
            .where(BatchRequest.id.in_(lapsed.scalar_subquery()))
            # A lease that ran out: its worker died or lost touch; not the lines' doing.
            .values(state="queued", lease_token=None, lease_expires_at=None, **budget.LOST_RUN)
        ).rowcount  # type: ignore[attr-defined]
    # A transaction of its own: holding those line locks while waiting for a batch lock
    # below would invert finalize's order (batch, then lines).
    with session_scope() as session:
        stats["exhausted"] = _fail_exhausted(session, settings)
        pending = (
            select(BatchRequest.id)
            .where(
                BatchRequest.batch_id == Batch.id,
                BatchRequest.state.in_(lifecycle.UNFINISHED),
            )
            .exists()
        )
        batches = session.execute(
            select(
                Batch.id, Batch.status, Batch.model, Batch.updated_at, Batch.expires_at, pending
            ).where(Batch.status.in_(("validating", "in_progress", "finalizing", "cancelling")))
        ).all()
    models: set[str] = set()
    for batch_id, status, model, updated_at, expires_at, has_pending in batches:
        stale = now - updated_at > settings.sweep_interval_seconds
        expired = expires_at is not None and now >= expires_at
        if status == "validating" and not expired:
            if stale:  # validating for a whole interval: its message was probably lost
                dispatcher.send(VALIDATE, batch_id)
        elif status == "in_progress" and model and has_pending and not expired:
            models.add(model)  # one wake-up per model, not one message per batch
        else:
            dispatcher.send(FINALIZE, batch_id)
    stats["batches"] = len(batches)
    with session_scope() as session:
        reg = catalog.registry(session, settings)
        # Workers of the model (an adapter's base) with nothing in flight.
        for base in {reg.base_of(m) for m in models}:
            routing.wake(session, base, idle_only=True)
    purge.kick(dispatcher)
    outbox.resend_due(dispatcher)
    return stats
