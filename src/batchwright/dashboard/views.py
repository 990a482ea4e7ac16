"""What the dashboard shows, computed from the rows: progress, rates, times, queues."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from batchwright.config import Settings
from batchwright.controlplane.heartbeats import live_after
from batchwright.db.models import Batch, BatchRequest, WorkerHeartbeat
from batchwright.protocol.endpoints import EMBEDDINGS

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
    # An embeddings batch generates nothing: its rate is the tokens it embedded.
    tokens = batch.input_tokens if batch.endpoint == EMBEDDINGS else batch.output_tokens
    rate = tokens / running if running and running > 0 else None
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
    """Failed lines (line, code, param, message), from the rows; file-level errors first."""
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
        rows.append({"line": line_no, "custom_id": custom_id, **_line_error(state, error)})
    return rows


def _line_error(state: str, error: str | None) -> dict[str, Any]:
    """The line's own error (code, param, message); `batch_<state>` only for a line that
    never ran and so has none."""
    import orjson

    body = orjson.loads(error) if error else None
    if not isinstance(body, dict):
        return {
            "code": f"batch_{state}",
            "param": None,
            "message": f"The batch was {state} before this line ran.",
        }
    return {
        "code": body.get("code"),
        "param": body.get("param"),
        "message": body.get("message") or "",
    }


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


@dataclass
class WorkerView:
    beat: WorkerHeartbeat
    live: bool
    seen: str
    silent_for: str


def workers(session: Session, settings: Settings, now: float | None = None) -> list[WorkerView]:
    """Workers from their heartbeats, live ones first. A worker is gone once its heartbeat
    is as stale as /v1/models judges it: a SIGKILLed worker's last row shows what it was
    doing when it died, not what it is doing now."""
    now = now or time.time()
    cutoff = live_after(settings)
    rows = session.scalars(
        select(WorkerHeartbeat).order_by(WorkerHeartbeat.last_seen.desc()).limit(100)
    )
    views = [
        WorkerView(
            beat=beat,
            live=beat.last_seen > cutoff,
            seen=stamp(beat.last_seen),
            silent_for=duration(now - beat.last_seen),
        )
        for beat in rows
    ]
    return sorted(views, key=lambda v: not v.live)  # stable: newest first within each
