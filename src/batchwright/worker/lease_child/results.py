"""Idempotent result writes: a row's result lands only while this lease still holds it.

A write is a few statements whatever its size (the control plane's cost per line). They
are built once, at import, with bound parameters: built and compiled per write through the
ORM's session they cost the writer thread about a millisecond of CPU each, and that CPU is
taken from the generation loop (the GIL, and on a small host a core). On Postgres the lines
are updated from arrays in one UPDATE and their completions go in by COPY (one message
stream instead of an INSERT per line).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import orjson
from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Connection,
    Integer,
    Select,
    String,
    Text,
    any_,
    bindparam,
    cast,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session

from batchwright.controlplane.dispatch import FINALIZE, enqueue
from batchwright.db.base import now
from batchwright.db.models import Batch, BatchRequest, Completion
from batchwright.engine.requests.types import GenResult

_UNFINISHED = ("queued", "running")

# Batch rows first, in id order: finalize locks a batch and then its lines, so taking the
# locks in that same order here rules out a deadlock between the two.
_LOCK_BATCHES = (
    select(Batch.id)
    .where(Batch.id.in_(bindparam("batch_ids", expanding=True)))
    .order_by(Batch.id)
    .with_for_update()
)


def _lock_lines(ids: ColumnElement[bool]) -> Select[int, str, str | None]:
    """Lines locked until commit, in id order: a sweeper or cancel that wants them waits,
    then sees them done. Found by primary key alone, their lease checked in Python: given
    the lease's columns too, the planner can pick their indexes and scan every line the
    lease holds when its statistics lag behind a fresh batch (seen: 2,000 for 32)."""
    return (
        select(BatchRequest.id, BatchRequest.state, BatchRequest.lease_token)
        .where(ids)
        .order_by(BatchRequest.id)
        .with_for_update()
    )


# An array is one statement text (prepared once by psycopg); SQLite has no arrays.
_LOCK_LINES = {
    True: _lock_lines(
        BatchRequest.id == any_(cast(bindparam("ids", type_=ARRAY(BigInteger)), ARRAY(BigInteger)))
    ),
    False: _lock_lines(BatchRequest.id.in_(bindparam("ids", expanding=True))),
}
# The batch's live counters, and how many of its lines are still to do (a later statement
# of the same transaction sees this one's updates).
_COUNT = (
    update(Batch)
    .where(Batch.id == bindparam("batch_id"))
    .values(
        completed=Batch.completed + bindparam("done"),
        failed=Batch.failed + bindparam("failed_n"),
        input_tokens=Batch.input_tokens + bindparam("tin"),
        output_tokens=Batch.output_tokens + bindparam("tout"),
        cached_tokens=Batch.cached_tokens + bindparam("cached"),
    )
    .returning(
        select(func.count())
        .where(BatchRequest.batch_id == Batch.id, BatchRequest.state.in_(_UNFINISHED))
        .scalar_subquery()
    )
)

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
_ROWS = (
    func.unnest(*(cast(bindparam(f"{c}s", type_=ARRAY(t)), ARRAY(t)) for c, t in _FINISHED))
    .table_valued(*(c for c, _ in _FINISHED))
    .render_derived()
)
# On Postgres one UPDATE joins the finished lines from arrays: executemany (the ORM's bulk
# update) sends a statement per line.
_FINISH_ARRAYS = (
    update(BatchRequest)
    .where(BatchRequest.id == _ROWS.c.id)
    .values(lease_token=None, lease_expires_at=None, **{c: _ROWS.c[c] for c, _ in _FINISHED[1:]})
)
_COMPLETION_COLUMNS = (
    "id",
    "request_row_id",
    "batch_id",
    "model",
    "body",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "created_at",
)
_COPY_COMPLETIONS = f"COPY completions ({', '.join(_COMPLETION_COLUMNS)}) FROM STDIN"


def write_results(session: Session, token: str, results: list[GenResult]) -> int:
    """Store results; returns how many landed. A line whose lease moved on is skipped: its
    lease expired and it was re-queued, cancelled or expired meanwhile."""
    conn = session.connection()
    postgres = conn.dialect.name == "postgresql"
    conn.execute(_LOCK_BATCHES, {"batch_ids": sorted({result.key[1] for result in results})})
    by_row = {result.key[0]: result for result in reversed(results)}  # twice: lands once
    lines = conn.execute(_LOCK_LINES[postgres], {"ids": sorted(by_row)}).all()
    landed = [by_row[i] for i, state, lease in lines if state == "running" and lease == token]
    if landed:
        _finish_rows(session, [_finished(r) for r in landed], postgres)
    deltas: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    completions: list[tuple[Any, ...]] = []
    created = now()
    for result in landed:
        row_id, batch_id = result.key
        delta = deltas[batch_id]
        if _ok(result):
            assert result.completion is not None
            completions.append(
                (
                    # An embeddings list has no id of its own: the line's row names it.
                    str(result.completion.get("id") or f"embd-{row_id}"),
                    row_id,
                    batch_id,
                    str(result.completion.get("model", "")),
                    # Embedding vectors are float32 arrays (protocol/embeddings.py).
                    orjson.dumps(result.completion, option=orjson.OPT_SERIALIZE_NUMPY).decode(),
                    result.prompt_tokens,
                    result.completion_tokens,
                    result.total_tokens,
                    created,
                )
            )
            delta[0] += 1
            delta[2] += result.prompt_tokens
            delta[3] += result.completion_tokens
            delta[4] += result.cached_tokens
        else:
            delta[1] += 1
    if completions:
        _insert_completions(conn, completions, postgres)
    for batch_id, (done, failed, tin, tout, cached) in deltas.items():
        counts = {"done": done, "failed_n": failed, "tin": tin, "tout": tout, "cached": cached}
        left = conn.execute(_COUNT, {"batch_id": batch_id, **counts}).scalar()
        if left == 0:
            enqueue(session, FINALIZE, batch_id)
    return len(landed)


def _ok(result: GenResult) -> bool:
    return result.status_code == 200 and result.completion is not None


def _finished(result: GenResult) -> dict[str, Any]:
    """The line's columns once its result lands."""
    ok = _ok(result)
    return {
        "id": result.key[0],
        "state": "succeeded" if ok else "failed",
        "status_code": result.status_code,
        "prompt_tokens": result.prompt_tokens if ok else 0,
        "completion_tokens": result.completion_tokens if ok else 0,
        "cached_tokens": result.cached_tokens if ok else 0,
        "error": None if ok else orjson.dumps(result.error).decode(),
    }


def _finish_rows(session: Session, updates: list[dict[str, Any]], postgres: bool) -> None:
    if postgres:
        arrays = {f"{c}s": [u[c] for u in updates] for c, _ in _FINISHED}
        session.connection().execute(_FINISH_ARRAYS, arrays)
    else:  # SQLite (`batchwright run`): the ORM's bulk UPDATE by primary key
        for u in updates:
            u.update(lease_token=None, lease_expires_at=None)
        session.execute(update(BatchRequest), updates)


def _insert_completions(conn: Connection, rows: list[tuple[Any, ...]], postgres: bool) -> None:
    if postgres:
        # psycopg's COPY on the session's own connection: the same transaction.
        driver = conn.connection.driver_connection
        with driver.cursor() as cursor, cursor.copy(_COPY_COMPLETIONS) as copy:  # type: ignore[union-attr]
            for row in rows:
                copy.write_row(row)
    else:
        named = [dict(zip(_COMPLETION_COLUMNS, row, strict=True)) for row in rows]
        conn.execute(insert(Completion), named)
