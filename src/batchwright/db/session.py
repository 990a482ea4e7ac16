"""Engines and sessions. Services never commit; the scope (or API dependency) does."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from batchwright.config import get_settings

log = logging.getLogger(__name__)


def normalize_url(url: str) -> str:
    # psycopg 3 is the driver; accept the plain scheme people paste.
    for plain in ("postgresql://", "postgres://"):
        if url.startswith(plain):
            return "postgresql+psycopg://" + url[len(plain) :]
    return url


@lru_cache
def get_engine(url: str | None = None) -> Engine:
    url = normalize_url(url or get_settings().resolved_database_url())
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _rec: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.close()

        return engine
    # pre_ping: a connection killed by pg_terminate_backend is replaced, not reused.
    settings = get_settings()
    return create_engine(
        url,
        pool_pre_ping=True,
        pool_size=settings.database_pool_size,
        max_overflow=settings.database_max_overflow,
    )


@lru_cache
def get_sessionmaker(url: str | None = None) -> sessionmaker[Session]:
    # Hooks on every Session (the webhook outbox) are installed by the process that composes
    # the app, the worker or the embedded run: persistence knows no feature.
    return sessionmaker(get_engine(url), expire_on_commit=False)


AfterCommit = Callable[[], None]


def after_commit(session: Session, fn: AfterCommit) -> None:
    """Run fn once the session's transaction commits (task sends go here)."""
    session.info.setdefault("after_commit", []).append(fn)


def run_after_commit(session: Session) -> None:
    pending: list[AfterCommit] = session.info.pop("after_commit", [])
    for fn in pending:
        try:
            fn()
        except Exception:
            # The commit is the truth: the write stands and the caller gets its answer; a
            # lost wake-up is re-sent by the sweeper (a broker that is down, say).
            log.warning("a send after commit failed; the sweeper re-sends it", exc_info=True)


@contextmanager
def session_scope(url: str | None = None) -> Iterator[Session]:
    session = get_sessionmaker(url)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        session.info.pop("after_commit", None)
        raise
    finally:
        session.close()
    run_after_commit(session)
