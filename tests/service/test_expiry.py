"""File expiry: expires_after on upload, output_expires_after, 404 once expired, the purge,
and a batch whose input expired before it ran."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from tests.helpers import jsonl, line, wait_batch

DAY = 24 * 3600


def _expire(pg: str, file_id: str) -> None:
    """Let the file's lifetime pass: move its expiry into the past."""
    with psycopg.connect(pg, autocommit=True) as conn:
        conn.execute(
            "UPDATE files SET expires_at = %s WHERE id = %s", (int(time.time()) - 1, file_id)
        )


def _wait(cond: Any, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.2)


@pytest.mark.parametrize(
    ("seconds", "code"),
    [(3599, "integer_below_min_value"), (30 * DAY + 1, "integer_above_max_value")],
)
def test_expires_after_out_of_range(client: OpenAI, seconds: int, code: str) -> None:
    with pytest.raises(BadRequestError) as info:
        client.files.create(
            file=("a.jsonl", jsonl([line("a")])),
            purpose="batch",
            expires_after={"anchor": "created_at", "seconds": seconds},
        )
    body = info.value.body
    assert isinstance(body, dict)
    assert (body["param"], body["code"]) == ("expires_after.seconds", code)


def test_upload_expiry_and_default(client: OpenAI) -> None:
    f = client.files.create(
        file=("a.jsonl", jsonl([line("a")])),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert f.expires_at == f.created_at + 3600
    assert client.files.retrieve(f.id).expires_at == f.created_at + 3600
    plain = client.files.create(file=("b.jsonl", jsonl([line("b")])), purpose="batch")
    assert plain.expires_at == plain.created_at + 30 * DAY


def test_output_expires_after(client: OpenAI) -> None:
    f = client.files.create(file=("a.jsonl", jsonl([line("a")])), purpose="batch")
    with pytest.raises(BadRequestError) as info:
        client.batches.create(
            input_file_id=f.id,
            endpoint="/v1/completions",
            completion_window="24h",
            output_expires_after={"anchor": "created_at", "seconds": 60},
        )
    assert isinstance(info.value.body, dict)
    assert info.value.body["param"] == "output_expires_after.seconds"
    batch = client.batches.create(
        input_file_id=f.id,
        endpoint="/v1/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    done = wait_batch(client, batch.id)
    assert done.status == "completed" and done.output_file_id
    out = client.files.retrieve(done.output_file_id)
    assert out.expires_at == out.created_at + 7200


def test_expired_file_is_gone_and_purged(
    client: OpenAI, service_env: dict[str, str], worker: Any
) -> None:
    pg = service_env["BATCHWRIGHT_DATABASE_URL"]
    size = int(service_env.get("BATCHWRIGHT_FILE_CHUNK_BYTES", 1024 * 1024))
    data = jsonl([line(f"p{i}", {"prompt": "x" * 2000}) for i in range(2 * size // 2000 + 10)])
    f = client.files.create(file=("big.jsonl", data), purpose="batch")
    keep = client.files.create(file=("keep.jsonl", jsonl([line("k")])), purpose="batch")
    _expire(pg, f.id)
    with pytest.raises(NotFoundError):
        client.files.retrieve(f.id)
    with pytest.raises(NotFoundError):
        client.files.content(f.id)
    assert f.id not in [x.id for x in client.files.list().data]

    def purged() -> bool:
        with psycopg.connect(pg) as conn:
            rows = conn.execute("SELECT count(*) FROM file_chunks WHERE file_id = %s", (f.id,))
            files = conn.execute("SELECT count(*) FROM files WHERE id = %s", (f.id,))
            return rows.fetchone() == (0,) and files.fetchone() == (0,)

    _wait(purged)  # the sweeper (every 2 s here) notices and the purge task removes it
    assert client.files.content(keep.id).content == jsonl([line("k")])


def _chunks(pg: str, file_id: str) -> int:
    with psycopg.connect(pg) as conn:
        row = conn.execute("SELECT count(*) FROM file_chunks WHERE file_id = %s", (file_id,))
        return int(row.fetchone()[0])  # type: ignore[index]


def test_purge_is_bounded_and_skips_locked_files(
    client: OpenAI, service_env: dict[str, str]
) -> None:
    from sqlalchemy import text

    from batchwright.db.session import session_scope
    from batchwright.files.purge import purge_step

    pg = service_env["BATCHWRIGHT_DATABASE_URL"]
    data = jsonl([line(f"q{i}", {"prompt": "y" * 3000}) for i in range(1200)])  # > 3 chunks
    f = client.files.create(file=("q.jsonl", data), purpose="batch")
    total = _chunks(pg, f.id)
    assert total >= 3
    with session_scope() as session:
        # Expire and purge in one transaction: the row lock keeps the suite's purge away,
        # so this step's bound is what is measured.
        session.execute(
            text("UPDATE files SET expires_at = :t WHERE id = :f"),
            {"t": int(time.time()) - 1, "f": f.id},
        )
        assert purge_step(session, 1) == (1, 0)
        left = session.scalar(
            text("SELECT count(*) FROM file_chunks WHERE file_id = :f"), {"f": f.id}
        )
        assert left == total - 1

    g = client.files.create(file=("g.jsonl", data), purpose="batch")
    with psycopg.connect(pg) as holder:
        # Validation share-locks its input file while it reads it; the purge skips it
        # at once instead of waiting (a wait would hang this test).
        _expire(pg, g.id)
        held = holder.execute("SELECT id FROM files WHERE id = %s FOR SHARE", (g.id,))
        if held.fetchone() is None:
            pytest.skip("the suite's purge removed the file before it could be locked")
        before = _chunks(pg, g.id)
        with session_scope() as session:
            purge_step(session, 1000)
        assert _chunks(pg, g.id) == before > 0
        holder.rollback()
    _wait(lambda: _chunks(pg, g.id) == 0)  # released: the sweeper's purge takes it


def test_batch_whose_input_expired_fails(client: OpenAI, service_env: dict[str, str]) -> None:
    from batchwright import control
    from batchwright.batches.service import create_batch
    from batchwright.config import get_settings
    from batchwright.controlplane.dispatch import InlineDispatcher, get_dispatcher, set_dispatcher
    from batchwright.db.session import session_scope
    from batchwright.protocol.batches import CreateBatch

    pg = service_env["BATCHWRIGHT_DATABASE_URL"]
    f = client.files.create(file=("late.jsonl", jsonl([line("late")])), purpose="batch")
    with psycopg.connect(pg) as conn:
        row = conn.execute("SELECT project_id FROM files WHERE id = %s", (f.id,)).fetchone()
    assert row is not None
    # Create the batch while the file is live, and hold its validate message back (as a
    # busy queue would) so that the file expires before validation runs.
    held = InlineDispatcher()
    previous = get_dispatcher()
    set_dispatcher(held)
    try:
        with session_scope() as session:
            req = CreateBatch(
                input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
            )
            batch_id = create_batch(session, row[0], req, get_settings()).id
        _expire(pg, f.id)
        with pytest.raises(NotFoundError):  # a new batch on it is refused outright
            client.batches.create(
                input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
            )
        control.validate_batch(batch_id)  # the held message finally runs
    finally:
        set_dispatcher(previous)
    failed = client.batches.retrieve(batch_id)
    assert failed.status == "failed" and failed.errors is not None, failed
    error = failed.errors.data[0]
    assert (error.code, error.param) == ("input_file_expired", "input_file_id")
    assert f.id in (error.message or "")
