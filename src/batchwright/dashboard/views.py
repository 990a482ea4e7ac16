"""What the dashboard shows, computed from the rows: progress, rates, times, queues."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, inspect, select, text
from sqlalchemy.orm import Session

from batchwright.db.models import Batch, BatchRequest

TERMINAL = {"completed", "failed", "cancelled", "expired"}


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s"


def stamp(unix: float | None) -> str:
    if unix is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix))


@dataclass
class BatchView:
    batch: Batch
    done: int
    percent: float
    tokens_per_second: float | None
    elapsed: str
    eta: str
    created: str

    @property
    def live(self) -> bool:
        return self.batch.status not in TERMINAL


def _ended_at(batch: Batch) -> int | None:
    for field in ("completed_at", "failed_at", "cancelled_at", "expired_at"):
        value: int | None = getattr(batch, field)
        if value is not None:
            return value
    return None


def batch_view(batch: Batch, now: float | None = None) -> BatchView:
    now = now or time.time()
    end = _ended_at(batch) or now
    done = batch.completed + batch.failed
    percent = 100.0 * done / batch.total if batch.total else 0.0
    running = end - batch.in_progress_at if batch.in_progress_at else None
    rate = batch.output_tokens / running if running and running > 0 else None
    eta = "-"
    if batch.status == "in_progress" and running and 0 < done < batch.total:
        eta = duration((batch.total - done) * running / done)
    elif batch.status in TERMINAL:
        eta = "done"
    return BatchView(
        batch=batch,
        done=done,
        percent=round(percent, 1),
        tokens_per_second=round(rate, 1) if rate is not None else None,
        elapsed=duration(end - batch.created_at),
        eta=eta,
        created=stamp(batch.created_at),
    )


def line_errors(session: Session, batch: Batch, limit: int = 100) -> list[dict[str, Any]]:
    """Failed lines (line, code, message), from the rows; file-level errors come first."""
    import orjson

    rows: list[dict[str, Any]] = [dict(e) for e in batch.errors or []]
    query = (
        select(BatchRequest.line_no, BatchRequest.custom_id, BatchRequest.state, BatchRequest.error)
        .where(
            BatchRequest.batch_id == batch.id,
            BatchRequest.state.in_(("failed", "cancelled", "expired")),
        )
        .order_by(BatchRequest.line_no)
        .limit(limit)
    )
    for line_no, custom_id, state, error in session.execute(query):
        body = orjson.loads(error) if error else {}
        rows.append(
            {
                "line": line_no,
                "custom_id": custom_id,
                "code": body.get("code") or f"batch_{state}",
                "message": body.get("message") or f"The batch was {state} before this line ran.",
            }
        )
    return rows


def queue_depth(session: Session) -> list[tuple[str, int, int]]:
    """(model, lines queued, lines running) across the service: what waits for workers."""
    query = (
        select(
            Batch.model,
            func.count().filter(BatchRequest.state == "queued"),
            func.count().filter(BatchRequest.state == "running"),
        )
        .join(Batch, Batch.id == BatchRequest.batch_id)
        .where(BatchRequest.state.in_(("queued", "running")))
        .group_by(Batch.model)
        .order_by(Batch.model)
    )
    return [(str(model), int(q), int(r)) for model, q, r in session.execute(query)]


def workers(session: Session) -> list[dict[str, Any]] | None:
    """Live workers from the heartbeat table, or None where this deployment records none.

    Hook for the service's worker heartbeats (a `worker_heartbeats` table with id, models,
    last_seen and, when present, rows_in_flight and tokens_per_second)."""
    if not inspect(session.get_bind()).has_table("worker_heartbeats"):
        return None
    try:
        with session.begin_nested():
            rows = session.execute(
                text("SELECT * FROM worker_heartbeats ORDER BY last_seen DESC LIMIT 100")
            ).mappings()
            return [dict(row) | {"seen": stamp(row["last_seen"])} for row in rows]
    except Exception:
        return None
