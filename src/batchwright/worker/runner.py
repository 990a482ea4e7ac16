"""What the tasks do. Celery tasks and the embedded driver both call these functions."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import orjson
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from batchwright.batches import lifecycle
from batchwright.config import get_settings
from batchwright.db.models import Batch, BatchRequest
from batchwright.db.session import session_scope
from batchwright.engine.types import GenResult
from batchwright.files import purge
from batchwright.registry import ModelSpec, Registry, load_registry
from batchwright.webhooks import outbox
from batchwright.worker.claims import Lease, is_out_of_memory
from batchwright.worker.dispatch import FINALIZE, PROCESS, VALIDATE, get_dispatcher
from batchwright.worker.results import write_results

if TYPE_CHECKING:
    from batchwright.engine.runtime import Engine

log = logging.getLogger(__name__)

# Set by SIGTERM handling (Celery's worker_shutting_down): stop claiming, finish what is held.
SHUTDOWN = threading.Event()
FLUSH_EVERY = 32
FLUSH_SECONDS = 0.5

_engines: dict[str, Engine] = {}


def engine_for(spec: ModelSpec) -> Engine:
    """One loaded model per process, loaded on first use (never at import or fork)."""
    if spec.name not in _engines:
        from batchwright.engine.runtime import Engine

        _engines.clear()  # one model resident at a time
        _engines[spec.name] = Engine.load(spec)
    return _engines[spec.name]


def validate_batch(batch_id: str, registry: Registry | None = None) -> None:
    settings = get_settings()
    with session_scope() as session:
        batch = lifecycle.lock(session, batch_id)
        if batch is not None:
            lifecycle.validate(session, batch, registry or load_registry(settings), settings)


def finalize_batch(batch_id: str) -> None:
    with session_scope() as session:
        batch = lifecycle.lock(session, batch_id)
        if batch is not None:
            lifecycle.finalize(session, batch, get_settings())


def process(
    model: str,
    registry: Registry | None = None,
    engine_provider: Callable[[ModelSpec], Engine] = engine_for,
) -> int:
    """Generate for queued rows of `model` until none are left or the time slice ends."""
    settings = get_settings()
    spec = (registry or load_registry(settings)).get(model)
    if spec is None:
        return 0
    engine = engine_provider(spec)
    landed = 0
    try:
        with Lease(model, settings, SHUTDOWN) as lease:
            buffer: list[GenResult] = []
            last = time.monotonic()
            for result in engine.run(lease.requests()):
                buffer.append(result)
                if len(buffer) >= FLUSH_EVERY or time.monotonic() - last >= FLUSH_SECONDS:
                    landed += _flush(lease.token, buffer)
                    buffer, last = [], time.monotonic()
            landed += _flush(lease.token, buffer)
    except Exception as exc:
        rows = getattr(engine, "max_rows", 1)
        if not is_out_of_memory(exc) or rows <= 1:
            raise
        # The lease gave the lines back unharmed; decode fewer rows at once and go again.
        engine.max_rows = max(1, rows // 2)
        log.warning("out of memory with %d rows; retrying with %d", rows, engine.max_rows)
        get_dispatcher().send(PROCESS, model)
        return landed
    if lease.more_work and not SHUTDOWN.is_set():
        get_dispatcher().send(PROCESS, model)
    return landed


def _flush(token: str, buffer: list[GenResult]) -> int:
    if not buffer:
        return 0
    with session_scope() as session:
        return write_results(session, token, buffer)


def _fail_exhausted(session: Session, max_attempts: int) -> int:
    """Lines out of attempts go to the error file with their last error."""
    exhausted = (BatchRequest.state == "queued", BatchRequest.attempts >= max_attempts)
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
            row.error = orjson.dumps(
                {
                    "message": f"Failed after {row.attempts} attempts. Last error: {reason}",
                    "type": "server_error",
                    "param": None,
                    "code": "max_attempts_exceeded",
                }
            ).decode()
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
        stats["requeued"] = session.execute(
            update(BatchRequest)
            .where(BatchRequest.state == "running", BatchRequest.lease_expires_at < now)
            .values(state="queued", lease_token=None, lease_expires_at=None)
        ).rowcount  # type: ignore[attr-defined]
    # A transaction of its own: holding those line locks while waiting for a batch lock
    # below would invert finalize's order (batch, then lines).
    with session_scope() as session:
        stats["exhausted"] = _fail_exhausted(session, settings.max_attempts)
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
    for model in models:
        dispatcher.send(PROCESS, model)
    purge.kick(dispatcher)
    outbox.resend_due(dispatcher)
    return stats
