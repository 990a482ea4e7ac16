"""A line's attempt budget (controlplane/budget.py), as the user sees it in the end: a
line fails for good only after failing alone, with its own error; runs lost to the
infrastructure and failed runs of several lines use up no line's attempts."""

from __future__ import annotations

import threading
from typing import Any

import orjson
import pytest
from sqlalchemy.exc import OperationalError

from tests.worker.conftest import add_batch


def _rows(batch_id: str) -> list[Any]:
    from sqlalchemy import select

    from batchwright.db.models import BatchRequest
    from batchwright.db.session import session_scope

    with session_scope() as session:
        rows = list(
            session.scalars(
                select(BatchRequest)
                .where(BatchRequest.batch_id == batch_id)
                .order_by(BatchRequest.line_no)
            )
        )
        session.expunge_all()
        return rows


def _failed_run(exc: BaseException) -> int:
    """A lease that claims what it may and fails with `exc`; returns how many it held."""
    from batchwright.config import get_settings
    from batchwright.worker.lease_child.claims import Lease

    held: list[Any] = []
    with pytest.raises(type(exc)), Lease("demo", get_settings(), threading.Event()) as lease:
        held.extend(lease.requests())
        raise exc
    return len(held)


def test_a_run_lost_to_the_infrastructure_costs_no_attempt(database: str) -> None:
    batch_id = add_batch(3)
    assert _failed_run(OperationalError("SELECT 1", None, ConnectionError("db gone"))) == 3
    rows = _rows(batch_id)
    assert [(r.state, r.attempts, r.infra_failures) for r in rows] == [("queued", 0, 1)] * 3


def test_a_failed_run_of_several_lines_charges_none_and_then_isolates_them(
    database: str,
) -> None:
    batch_id = add_batch(3)
    for _ in range(2):
        assert _failed_run(RuntimeError("engine crashed")) == 3
    rows = _rows(batch_id)
    assert [(r.state, r.attempts, r.shared_failures) for r in rows] == [("queued", 0, 2)] * 3
    # Twice in a failed run: each line now runs alone, one lease each.
    assert _failed_run(RuntimeError("engine crashed")) == 1


def test_a_line_failing_alone_uses_its_attempts_and_ends_failed_with_its_error(
    database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchwright import control
    from batchwright.config import get_settings

    monkeypatch.setenv("BATCHWRIGHT_MAX_ATTEMPTS", "2")
    get_settings.cache_clear()
    batch_id = add_batch(1)
    for attempt in (1, 2):
        assert _failed_run(RuntimeError("poison line")) == 1
        (row,) = _rows(batch_id)
        assert (row.state, row.attempts) == ("queued", attempt)
    assert _failed_run(RuntimeError("poison line")) == 0  # out of attempts: not claimed
    control.sweep()
    (row,) = _rows(batch_id)
    assert (row.state, row.status_code) == ("failed", 500)
    error = orjson.loads(row.error)
    assert error["code"] == "max_attempts_exceeded"
    assert "Failed after 2 attempts" in error["message"]
    assert "poison line" in error["message"]
