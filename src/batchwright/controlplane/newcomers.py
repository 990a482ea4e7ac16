"""A signal that a batch started, so a lease handing out a claim can let it go first.

Validation announces each batch it starts with a Postgres NOTIFY (delivered on commit);
a lease listens on its own connection and reads notifications without a round trip
(microseconds), so it learns of a newcomer within a step instead of after its current
claim. It looks at most every POLL_SECONDS: each look is a system call that lets go of the
GIL, and one per line handed to the engine made the claim thread fight the generation loop
for it 2,000 times a file. Without Postgres (the embedded SQLite run has one batch at a
time) or if the listening connection fails, the lease falls back to looking every
FALLBACK_SECONDS.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from batchwright.config import Settings

log = logging.getLogger(__name__)

CHANNEL = "batchwright_batch_started"
FALLBACK_SECONDS = 1.0
POLL_SECONDS = 0.01


def announce(session: Session, model: str) -> None:
    """Tell listening leases that a batch of `model` started (on commit)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(func.pg_notify(CHANNEL, model)))


class Listener:
    """`heard()`: whether a batch of `model` may have started since the last call."""

    def __init__(self, model: str, settings: Settings) -> None:
        self.model = model
        self._conn: Any = None
        self._next = time.monotonic() + FALLBACK_SECONDS
        self._poll = 0.0
        url = settings.resolved_database_url()
        if not url.startswith(("postgresql", "postgres")):
            return
        try:
            import psycopg

            self._conn = psycopg.connect(url.replace("+psycopg", "", 1), autocommit=True)
            self._conn.execute(f"LISTEN {CHANNEL}")
        except Exception:
            log.warning("cannot listen for new batches; looking every %ss", FALLBACK_SECONDS)
            self.close()

    def heard(self) -> bool:
        if self._conn is not None:
            now = time.monotonic()
            if now < self._poll:
                return False
            self._poll = now + POLL_SECONDS
            try:
                return any(n.payload == self.model for n in self._conn.notifies(timeout=0))
            except Exception:
                log.warning("lost the new-batch listener; looking every %ss", FALLBACK_SECONDS)
                self.close()
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + FALLBACK_SECONDS
        return True

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None
