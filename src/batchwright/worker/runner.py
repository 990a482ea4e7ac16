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

from batchwright.batches import lifecycle, redrive
from batchwright.config import Settings, get_settings
from batchwright.db.models import Batch, BatchRequest
from batchwright.db.session import session_scope
from batchwright.files import purge
from batchwright.registry import ModelSpec, Registry, load_registry
from batchwright.webhooks import outbox
from batchwright.worker import budget, lease_process, metrics, pipeline, routing
from batchwright.worker.claims import Lease, is_out_of_memory
from batchwright.worker.dispatch import FINALIZE, PROCESS, VALIDATE, get_dispatcher

if TYPE_CHECKING:
    from batchwright.engine.runtime import Engine

log = logging.getLogger(__name__)

# Set by SIGTERM handling (Celery's worker_shutting_down): stop claiming, finish what is held.
SHUTDOWN = threading.Event()

_engines: dict[str, Engine] = {}


def engine_for(spec: ModelSpec) -> Engine:
    """One loaded model per process, loaded on first use (never at import or fork)."""
    if spec.name not in _engines:
        from batchwright.engine.runtime import Engine

        # A worker holds only the models it was started with (--models), each loaded once.
        _engines[spec.name] = Engine.load(spec)
        set_cpu_threads(_engines[spec.name], get_settings())
        metrics.instrument(_engines[spec.name], spec.name)
        metrics.loaded(spec.name)
    return _engines[spec.name]


def set_cpu_threads(engine: Engine, settings: Settings) -> None:
    """Intra-op threads of a model on the CPU: `torch_threads`, or with the lease process
    one fewer than the cores: the lease process and a local Postgres would otherwise
    preempt a thread of the engine's while the others wait for it at the step's barriers
    (figures in docs/scaling.md)."""
    import os

    import torch

    if settings.torch_threads > 0:
        torch.set_num_threads(settings.torch_threads)
    elif lease_process.wanted(settings) and str(engine.lm.device) == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))


def validate_batch(batch_id: str, registry: Registry | None = None) -> None:
    settings = get_settings()

    def run() -> None:
        with session_scope() as session:
            batch = lifecycle.lock(session, batch_id)
            if batch is not None:
                lifecycle.validate(session, batch, registry or load_registry(settings), settings)

    redrive.guarded("validation", batch_id, settings, run)


def finalize_batch(batch_id: str) -> None:
    settings = get_settings()

    def run() -> None:
        with session_scope() as session:
            batch = lifecycle.lock(session, batch_id)
            if batch is not None:
                lifecycle.finalize(session, batch, settings)

    redrive.guarded("finalization", batch_id, settings, run)


def process(
    model: str,
    registry: Registry | None = None,
    engine_provider: Callable[[ModelSpec], Engine] = engine_for,
) -> int:
    """Generate for queued rows of `model` until none are left or the time slice ends."""
    settings = get_settings()
    spec = (registry or load_registry(settings)).get(model)
    if spec is None or not routing.serves(model, settings):
        return 0
    engine = engine_provider(spec)
    landed = 0
    try:
        lease: Lease | lease_process.RemoteLease
        if lease_process.wanted(settings):
            with lease_process.RemoteLease(model, settings, SHUTDOWN) as lease:
                lease.run(engine)
            landed = lease.landed
        else:
            with Lease(model, settings, SHUTDOWN) as lease:
                lease.cancels.on_batch = finalize_batch
                landed = pipeline.generate(
                    engine, lease, model, settings, cancelled=lease.cancelled
                )
    except Exception as exc:
        rows = getattr(engine, "max_rows", 1)
        if not is_out_of_memory(exc) or rows <= 1:
            raise
        # The lease gave the lines back unharmed; decode fewer rows at once and go again.
        engine.max_rows = max(1, rows // 2)
        metrics.OOM_HALVINGS.labels(model).inc()
        log.warning("out of memory with %d rows; retrying with %d", rows, engine.max_rows)
        get_dispatcher().send(PROCESS, model)
        return landed
    if lease.more_work and not SHUTDOWN.is_set():
        get_dispatcher().send(PROCESS, model)
    return landed


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
        stats["requeued"] = session.execute(
            update(BatchRequest)
            .where(BatchRequest.state == "running", BatchRequest.lease_expires_at < now)
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
        for model in models:  # workers of the model with nothing in flight
            routing.wake(session, model, idle_only=True)
    purge.kick(dispatcher)
    outbox.resend_due(dispatcher)
    return stats
