"""The result writer is idempotent: a line's result lands once whatever repeats it (a
redelivered write, a result sent twice), and only while the writing lease holds the line.
The batch's counts and token usage, which the user reads on the batch, count it once."""

from __future__ import annotations

import threading
from typing import Any

from tests.worker.conftest import add_batch


def _claim_all(lease: Any) -> list[Any]:
    return list(lease.requests())


def _result(req: Any, n: int) -> Any:
    from batchwright.engine.requests.types import GenResult

    return GenResult(
        key=req.key,
        status_code=200,
        completion={
            "id": f"cmpl-{req.key[0]}-{n}",
            "object": "text_completion",
            "model": "demo",
            "choices": [{"index": 0, "text": "ok", "logprobs": None, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        },
        prompt_tokens=3,
        completion_tokens=2,
    )


def _batch(batch_id: str) -> Any:
    from batchwright.db.models import Batch
    from batchwright.db.session import session_scope

    with session_scope() as session:
        batch = session.get(Batch, batch_id)
        assert batch is not None
        session.expunge(batch)
        return batch


def _count(sql: str, batch_id: str) -> int:
    from sqlalchemy import text

    from batchwright.db.session import session_scope

    with session_scope() as session:
        return int(session.execute(text(sql), {"b": batch_id}).scalar_one())


def test_the_same_results_written_twice_land_once(database: str) -> None:
    from batchwright.config import get_settings
    from batchwright.controlplane import dispatch
    from batchwright.db.session import session_scope
    from batchwright.worker.lease_child.claims import Lease
    from batchwright.worker.lease_child.results import write_results

    batch_id = add_batch(4)
    with Lease("demo", get_settings(), threading.Event()) as lease:
        reqs = _claim_all(lease)
        assert len(reqs) == 4
        results = [_result(r, 1) for r in reqs]
        with session_scope() as session:
            first = write_results(session, lease.token, results[:3])
        # Again, with the fourth now (a write retried after its commit was not heard).
        with session_scope() as session:
            second = write_results(session, lease.token, results)
        # A result sent twice within one write.
        with session_scope() as session:
            third = write_results(session, lease.token, [results[3], results[3]])
    assert (first, second, third) == (3, 1, 0)
    batch = _batch(batch_id)
    assert (batch.completed, batch.failed) == (4, 0)
    assert (batch.input_tokens, batch.output_tokens) == (4 * 3, 4 * 2)
    assert _count("SELECT count(*) FROM completions WHERE batch_id = :b", batch_id) == 4
    states = "SELECT count(*) FROM batch_requests WHERE batch_id = :b AND state = 'succeeded'"
    assert _count(states, batch_id) == 4
    # The batch's last line landed: its finalize is announced once.
    sent = dispatch.get_dispatcher()
    assert isinstance(sent, dispatch.InlineDispatcher)
    assert list(sent.queue).count((dispatch.FINALIZE, (batch_id,))) == 1


def test_a_result_lands_only_under_the_lease_that_holds_its_line(database: str) -> None:
    """A lease that lost its lines (expired, re-claimed by another) writes nothing; the
    holder's result is the one the user gets."""
    from sqlalchemy import update

    from batchwright.config import get_settings
    from batchwright.db.models import BatchRequest
    from batchwright.db.session import session_scope
    from batchwright.worker.lease_child.claims import Lease
    from batchwright.worker.lease_child.results import write_results

    batch_id = add_batch(2)
    settings = get_settings()
    with Lease("demo", settings, threading.Event()) as old:
        stale = [_result(r, 1) for r in _claim_all(old)]
        # Its lease ran out and the sweeper gave the lines back (charged to no one).
        with session_scope() as session:
            session.execute(
                update(BatchRequest)
                .where(BatchRequest.batch_id == batch_id)
                .values(state="queued", lease_token=None, lease_expires_at=None)
            )
        with Lease("demo", settings, threading.Event()) as new:
            fresh = [_result(r, 2) for r in _claim_all(new)]
            with session_scope() as session:
                assert write_results(session, old.token, stale) == 0
            with session_scope() as session:
                assert write_results(session, new.token, fresh) == 2
            with session_scope() as session:
                assert write_results(session, old.token, stale) == 0
    batch = _batch(batch_id)
    assert (batch.completed, batch.input_tokens, batch.output_tokens) == (2, 6, 4)
    ids = "SELECT count(*) FROM completions WHERE batch_id = :b AND id LIKE 'cmpl-%%-2'"
    assert _count(ids, batch_id) == 2
    assert _count("SELECT count(*) FROM completions WHERE batch_id = :b", batch_id) == 2


def test_the_writer_thread_lands_each_result_once(database: str) -> None:
    """ResultWriter, the generation loop's way to write (off the loop): results put twice
    land once, and its count of landed results says so."""
    from batchwright.config import get_settings
    from batchwright.worker.lease_child.claims import Lease
    from batchwright.worker.lease_child.pipeline import ResultWriter

    batch_id = add_batch(5)
    settings = get_settings()
    with Lease("demo", settings, threading.Event()) as lease:
        results = [_result(r, 1) for r in _claim_all(lease)]
        writer = ResultWriter(lease.token, "demo", settings.result_queue_size, 30)
        with writer:
            for result in results + results:
                writer.put(result)
    assert writer.landed == 5
    batch = _batch(batch_id)
    assert (batch.completed, batch.input_tokens, batch.output_tokens) == (5, 15, 10)
