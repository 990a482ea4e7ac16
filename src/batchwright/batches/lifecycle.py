"""Batch state transitions after creation. Every function expects the batch row locked
(or freshly created) and leaves committing to the caller.

validating -> in_progress -> finalizing -> completed
validating -> failed;  (validating|in_progress) -> cancelling -> cancelled;  -> expired
"""

from __future__ import annotations

import time

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from batchwright.batches import output
from batchwright.batches.validation import enforce_quotas, scan_input
from batchwright.config import Settings
from batchwright.controlplane import newcomers, routing
from batchwright.controlplane.dispatch import FINALIZE, enqueue
from batchwright.db.base import now
from batchwright.db.models import Batch, BatchRequest
from batchwright.files import expiry
from batchwright.registry import Registry

TERMINAL = {"completed", "failed", "cancelled", "expired"}
UNFINISHED = ("queued", "running")


def lock(session: Session, batch_id: str) -> Batch | None:
    return session.scalar(select(Batch).where(Batch.id == batch_id).with_for_update())


def touch(batch: Batch) -> None:
    batch.updated_at = time.time()


def validate(session: Session, batch: Batch, registry: Registry, settings: Settings) -> None:
    if batch.status != "validating":
        return  # a redelivered message for a batch that moved on
    if batch.expires_at is not None and now() >= batch.expires_at:
        finish(session, batch, "expired", settings)
        return
    if expiry.input_gone(session, batch):
        return
    outcome = scan_input(session, batch, registry, settings)
    if not outcome.errors:
        enforce_quotas(session, batch, outcome)
    touch(batch)
    batch.model = outcome.model
    if outcome.errors:
        batch.status, batch.failed_at = "failed", now()
        batch.errors = [e.as_dict() for e in outcome.errors]
        return
    batch.status, batch.in_progress_at = "in_progress", now()
    batch.total, batch.failed = outcome.total, outcome.rejected
    if outcome.rejected == outcome.total:
        enqueue(session, FINALIZE, batch.id)
    else:
        # A LoRA adapter's lines are its base model's workers' to claim.
        base = registry.base_of(str(batch.model))
        newcomers.announce(session, base)
        routing.wake(session, base)


def start_cancel(session: Session, batch: Batch) -> None:
    batch.status, batch.cancelling_at = "cancelling", now()
    touch(batch)
    enqueue(session, FINALIZE, batch.id)


def unfinished(session: Session, batch_id: str, *, live_leases_only: bool = False) -> int:
    query = select(func.count()).where(
        BatchRequest.batch_id == batch_id, BatchRequest.state.in_(UNFINISHED)
    )
    if live_leases_only:
        query = query.where(
            BatchRequest.state == "running", BatchRequest.lease_expires_at > time.time()
        )
    return int(session.scalar(query) or 0)


def finalize(session: Session, batch: Batch, settings: Settings) -> None:
    """Move a batch toward its terminal state if it can go there now; else leave it."""
    if batch.status in TERMINAL or (batch.status == "validating" and not _past_window(batch)):
        return
    if batch.status == "in_progress" and unfinished(session, batch.id) == 0:
        # Every line finished: the batch completed, even if this finalize runs only after
        # the window closed (expired means lines were left undone, and none were).
        batch.status, batch.finalizing_at = "finalizing", now()
        finish(session, batch, "completed", settings)
    elif _past_window(batch) and batch.status in ("validating", "in_progress"):
        finish(session, batch, "expired", settings)
    elif batch.status == "cancelling":
        # Lines in flight get to finish; the sweeper comes back while any lease is live.
        if unfinished(session, batch.id, live_leases_only=True) == 0:
            finish(session, batch, "cancelled", settings)
    elif batch.status == "finalizing":
        finish(session, batch, "completed", settings)


def _past_window(batch: Batch) -> bool:
    return batch.expires_at is not None and now() >= batch.expires_at


def finish(session: Session, batch: Batch, status: str, settings: Settings) -> None:
    """Close unfinished lines as `status`, render the files, recount, set the terminal status."""
    if status in ("cancelled", "expired"):
        session.execute(
            update(BatchRequest)
            .where(BatchRequest.batch_id == batch.id, BatchRequest.state.in_(UNFINISHED))
            .values(state=status, lease_token=None, lease_expires_at=None)
        )
    recount(session, batch)
    if batch.total:
        output.render(session, batch, settings)
    if status in ("cancelled", "expired"):
        # Lines that never ran count as failed, as the error file lists them.
        batch.failed = batch.total - batch.completed
    batch.status = status
    setattr(batch, f"{status}_at", now())
    touch(batch)


def recount(session: Session, batch: Batch) -> None:
    """Counters from the rows themselves: the live increments are only a progress view."""
    states: dict[str, int] = {
        state: count
        for state, count in session.execute(
            select(BatchRequest.state, func.count())
            .where(BatchRequest.batch_id == batch.id)
            .group_by(BatchRequest.state)
        )
    }
    batch.total = sum(states.values()) or batch.total
    batch.completed = states.get("succeeded", 0)
    batch.failed = states.get("failed", 0)
    tokens = session.execute(
        select(
            func.coalesce(func.sum(BatchRequest.prompt_tokens), 0),
            func.coalesce(func.sum(BatchRequest.completion_tokens), 0),
            func.coalesce(func.sum(BatchRequest.cached_tokens), 0),
        ).where(BatchRequest.batch_id == batch.id)
    ).one()
    batch.input_tokens, batch.output_tokens = int(tokens[0]), int(tokens[1])
    batch.cached_tokens = int(tokens[2])
