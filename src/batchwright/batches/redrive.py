"""Bounded re-drives: a batch whose validate or finalize keeps raising ends `failed`.

The sweeper re-sends validate and finalize for batches that stand still; without a bound,
a batch whose input makes validation raise would be re-driven every interval until its
window closes. Each run that raises is counted on the batch (a transaction of its own,
as the failed one rolled back); at `max_batch_failures` the batch fails with an error
that names the stage and the exception. A database or broker outage is not counted:
it is not the batch's doing, and Celery's retries and the window bound it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import orjson
from sqlalchemy import update
from sqlalchemy.exc import InterfaceError, OperationalError

from batchwright.batches import lifecycle, output
from batchwright.config import Settings
from batchwright.db.base import now
from batchwright.db.models import BatchRequest
from batchwright.db.session import session_scope

log = logging.getLogger(__name__)

OUTAGES: tuple[type[BaseException], ...] = (
    OperationalError,
    InterfaceError,
    ConnectionError,
    TimeoutError,
)


def is_outage(exc: BaseException) -> bool:
    # Broker clients (redis, kombu) raise their own ConnectionError/OperationalError types.
    return isinstance(exc, OUTAGES) or type(exc).__name__ in (
        "ConnectionError",
        "OperationalError",
        "TimeoutError",
    )


def guarded(stage: str, batch_id: str, settings: Settings, run: Callable[[], None]) -> None:
    """Run one stage of a batch; count it on the batch when it raises (then re-raise)."""
    try:
        run()
    except Exception as exc:
        if not is_outage(exc):
            try:
                record_failure(stage, batch_id, exc, settings)
            except Exception:  # the database went too: the stage's own error says more
                log.exception("could not record the failure of %s for %s", stage, batch_id)
        raise


def record_failure(stage: str, batch_id: str, exc: BaseException, settings: Settings) -> None:
    with session_scope() as session:
        batch = lifecycle.lock(session, batch_id)
        if batch is None or batch.status in lifecycle.TERMINAL:
            return
        batch.failures = (batch.failures or 0) + 1
        lifecycle.touch(batch)
        what = f"{type(exc).__name__}: {str(exc)[:300]}"
        log.warning("%s of %s failed (%d): %s", stage, batch_id, batch.failures, what)
        if batch.failures < settings.max_batch_failures:
            return
        message = f"The batch's {stage} failed {batch.failures} times; last error: {what}"
        error = {"message": message, "type": "server_error", "param": None, "code": "server_error"}
        session.execute(
            update(BatchRequest)
            .where(
                BatchRequest.batch_id == batch.id,
                BatchRequest.state.in_(lifecycle.UNFINISHED),
            )
            .values(
                state="failed",
                status_code=500,
                error=orjson.dumps(error).decode(),
                lease_token=None,
                lease_expires_at=None,
            )
        )
        lifecycle.recount(session, batch)
        if batch.total and stage != "validation":
            # Keep what finished if the files can still be written; the render may be
            # the very thing that fails, so it runs in a savepoint.
            try:
                with session.begin_nested():
                    output.render(session, batch, settings)
            except Exception:
                log.exception("no output files for failed batch %s", batch.id)
        batch.status, batch.failed_at = "failed", now()
        batch.errors = [
            {"code": f"{stage}_failed", "line": None, "message": message, "param": None}
        ]
