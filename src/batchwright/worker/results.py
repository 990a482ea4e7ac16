"""Idempotent result writes: a row's result lands only while this lease still holds it."""

from __future__ import annotations

from collections import defaultdict

import orjson
from sqlalchemy import (
    BigInteger,
    Integer,
    String,
    Text,
    cast,
    func,
    insert,
    literal,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session

from batchwright.db.base import now
from batchwright.db.models import Batch, BatchRequest, Completion
from batchwright.engine.types import GenResult
from batchwright.worker.dispatch import FINALIZE, enqueue


def write_results(session: Session, token: str, results: list[GenResult]) -> int:
    """Store results; returns how many landed. A row whose lease moved on is skipped.

    A few statements per call whatever its size (the control plane's cost per line): the
    rows this lease still holds are locked in one SELECT, then updated and their
    completions inserted in bulk."""
    # Batch rows first, in id order: finalize locks a batch and then its lines, so taking
    # the locks in that same order here rules out a deadlock between the two.
    batch_ids = sorted({result.key[1] for result in results})
    session.execute(
        select(Batch.id).where(Batch.id.in_(batch_ids)).order_by(Batch.id).with_for_update()
    )
    # Locked until commit: a sweeper or cancel that wants them waits, then sees them done.
    held = set(
        session.scalars(
            select(BatchRequest.id)
            .where(
                BatchRequest.id.in_([result.key[0] for result in results]),
                BatchRequest.state == "running",
                BatchRequest.lease_token == token,
            )
            .order_by(BatchRequest.id)
            .with_for_update()
        )
    )
    deltas: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    cached: dict[str, int] = defaultdict(int)
    updates: list[dict[str, object]] = []
    completions: list[dict[str, object]] = []
    for result in results:
        row_id, batch_id = result.key
        if row_id not in held:
            continue  # lease expired and the row was re-queued, cancelled or expired
        held.discard(row_id)  # a result twice in one call lands once
        ok = result.status_code == 200 and result.completion is not None
        updates.append(
            {
                "id": row_id,
                "state": "succeeded" if ok else "failed",
                "status_code": result.status_code,
                "lease_token": None,
                "lease_expires_at": None,
                "prompt_tokens": result.prompt_tokens if ok else 0,
                "completion_tokens": result.completion_tokens if ok else 0,
                "cached_tokens": result.cached_tokens if ok else 0,
                "error": None if ok else orjson.dumps(result.error).decode(),
            }
        )
        delta = deltas[batch_id]
        if ok:
            assert result.completion is not None
            completions.append(
                {
                    "id": str(result.completion["id"]),
                    "request_row_id": row_id,
                    "batch_id": batch_id,
                    "model": str(result.completion.get("model", "")),
                    "body": orjson.dumps(result.completion).decode(),
                    "prompt_tokens": result.prompt_tokens,
                    "completion_tokens": result.completion_tokens,
                    "total_tokens": result.total_tokens,
                    "created_at": now(),
                }
            )
            delta[0] += 1
            delta[2] += result.prompt_tokens
            delta[3] += result.completion_tokens
            cached[batch_id] += result.cached_tokens
        else:
            delta[1] += 1
    if updates:
        _finish_rows(session, updates)
    if completions:
        session.execute(insert(Completion), completions)
    for batch_id, (done, failed, tin, tout) in deltas.items():
        session.execute(
            update(Batch)
            .where(Batch.id == batch_id)
            .values(
                completed=Batch.completed + done,
                failed=Batch.failed + failed,
                input_tokens=Batch.input_tokens + tin,
                output_tokens=Batch.output_tokens + tout,
                cached_tokens=Batch.cached_tokens + cached[batch_id],
            )
        )
        if remaining(session, batch_id) == 0:
            enqueue(session, FINALIZE, batch_id)
    session.flush()
    return len(updates)


# Columns a result writes on its line, with their array types for Postgres's unnest.
_FINISHED = (
    ("id", BigInteger),
    ("state", String),
    ("status_code", Integer),
    ("prompt_tokens", Integer),
    ("completion_tokens", Integer),
    ("cached_tokens", Integer),
    ("error", Text),
)


def _finish_rows(session: Session, updates: list[dict[str, object]]) -> None:
    """Write the finished lines. On Postgres one UPDATE joins them from arrays: executemany
    (the ORM's bulk update) sends a statement per line and costs the worker's CPU about as
    much per line as generating it on a small model. SQLite (`batchwright run`) keeps it."""
    if session.get_bind().dialect.name != "postgresql":
        session.execute(update(BatchRequest), updates)  # ORM bulk UPDATE by primary key
        return
    arrays = [cast(literal([u[c] for u in updates], ARRAY(t)), ARRAY(t)) for c, t in _FINISHED]
    rows = func.unnest(*arrays).table_valued(*(c for c, _ in _FINISHED)).render_derived()
    values = {c: rows.c[c] for c, _ in _FINISHED[1:]}
    session.execute(
        update(BatchRequest)
        .where(BatchRequest.id == rows.c.id)
        .values(lease_token=None, lease_expires_at=None, **values)
        .execution_options(synchronize_session=False)
    )


def remaining(session: Session, batch_id: str) -> int:
    return int(
        session.scalar(
            select(func.count()).where(
                BatchRequest.batch_id == batch_id,
                BatchRequest.state.in_(("queued", "running")),
            )
        )
        or 0
    )
