"""A Postgres database of its own per test (migrated to head), this process's settings
pointed at it, and messages sent after commit kept in memory (the embedded run's
dispatcher) instead of going to a broker that other test runs share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import create_database, drop_database


def _reset() -> None:
    from batchwright.config import get_settings
    from batchwright.db.session import get_engine, get_sessionmaker

    get_settings.cache_clear()
    get_sessionmaker.cache_clear()
    get_engine.cache_clear()


@pytest.fixture
def database(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    from batchwright.controlplane import dispatch
    from batchwright.db.migrate import upgrade_head
    from batchwright.db.session import get_engine

    url = create_database("bw_worker")
    monkeypatch.setenv("BATCHWRIGHT_DATABASE_URL", url)
    monkeypatch.setenv("BATCHWRIGHT_LEASE_SECONDS", "30")
    monkeypatch.delenv("BATCHWRIGHT_MODELS", raising=False)  # the registry: `demo` alone
    monkeypatch.setattr(dispatch, "_dispatcher", dispatch.InlineDispatcher())
    _reset()
    upgrade_head(url)
    try:
        yield url
    finally:
        get_engine().dispose()
        monkeypatch.undo()
        _reset()
        drop_database(url)


def add_batch(lines: int, model: str = "demo") -> str:
    """A batch of `model` in progress with `lines` queued lines, as validation leaves it."""
    import orjson

    from batchwright.auth.service import get_or_create_project
    from batchwright.db.base import new_id, now
    from batchwright.db.models import Batch, BatchRequest
    from batchwright.db.session import session_scope

    with session_scope() as session:
        project = get_or_create_project(session, "team-worker")
        batch = Batch(
            id=new_id("batch_"),
            project_id=project.id,
            endpoint="/v1/completions",
            model=model,
            input_file_id=new_id("file-"),
            completion_window="24h",
            status="in_progress",
            created_at=now(),
            in_progress_at=now(),
            updated_at=float(now()),
            total=lines,
        )
        session.add(batch)
        session.flush()
        for i in range(lines):
            body = {"model": model, "prompt": f"line {i}", "max_tokens": 2}
            session.add(
                BatchRequest(
                    batch_id=batch.id,
                    line_no=i,
                    custom_id=f"r{i}",
                    body=orjson.dumps(body).decode(),
                    state="queued",
                )
            )
        return batch.id
