"""Dashboard sessions: signing in with a key opens one; the browser holds a random token,
never the key, and the database only its sha256. A session acts for the key that opened
it and ends when it expires, when its user signs out, or when that key is revoked."""

from __future__ import annotations

import secrets

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from batchwright.auth.service import authenticate_key, hash_key
from batchwright.db.base import now
from batchwright.db.models import APIKey, DashboardSession


def open_session(session: Session, key_secret: str, lifetime: int) -> str:
    """A new session's token for a key (401 if the key is not live)."""
    key = authenticate_key(session, f"Bearer {key_secret}")
    stamp = now()
    # Sign-ins are rare: clearing expired sessions here keeps the table small.
    session.execute(delete(DashboardSession).where(DashboardSession.expires_at <= stamp))
    token = secrets.token_urlsafe(32)
    session.add(
        DashboardSession(
            id=hash_key(token), key_id=key.id, created_at=stamp, expires_at=stamp + lifetime
        )
    )
    session.flush()
    return token


def session_project(session: Session, token: str) -> str | None:
    """The project a live session acts for, or None."""
    return session.scalar(
        select(APIKey.project_id)
        .join(DashboardSession, DashboardSession.key_id == APIKey.id)
        .where(
            DashboardSession.id == hash_key(token),
            DashboardSession.expires_at > now(),
            APIKey.revoked_at.is_(None),
        )
    )


def close_session(session: Session, token: str) -> None:
    session.execute(delete(DashboardSession).where(DashboardSession.id == hash_key(token)))
