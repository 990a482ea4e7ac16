"""Projects and API keys. Keys are shown once and stored as sha256 hashes."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from batchwright.db.base import new_id, now
from batchwright.db.models import APIKey, DashboardSession, Project
from batchwright.errors import NotFound, Unauthorized

KEY_PREFIX = "sk-bw-"


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def get_or_create_project(session: Session, name: str) -> Project:
    project = session.scalar(select(Project).where(Project.name == name))
    if project is None:
        project = Project(id=new_id("proj_"), name=name, created_at=now())
        session.add(project)
        session.flush()
    return project


def create_key(
    session: Session, project_name: str, key_name: str = "default"
) -> tuple[APIKey, str]:
    project = get_or_create_project(session, project_name)
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    key = APIKey(
        id=new_id("key_"),
        project_id=project.id,
        name=key_name,
        key_hash=hash_key(secret),
        prefix=secret[: len(KEY_PREFIX) + 4],
        created_at=now(),
    )
    session.add(key)
    session.flush()
    return key, secret


def revoke_key(session: Session, key_id: str) -> APIKey:
    key = session.get(APIKey, key_id)
    if key is None:
        raise NotFound(f"No such API key: {key_id}")
    if key.revoked_at is None:
        key.revoked_at = now()
    # Its dashboard sessions end with it (auth/sessions.py also checks the key on every page).
    session.execute(delete(DashboardSession).where(DashboardSession.key_id == key.id))
    session.flush()
    return key


def authenticate(session: Session, authorization: str | None) -> str:
    """Project id for a `Bearer <key>` header, or 401."""
    return authenticate_key(session, authorization).project_id


def authenticate_key(session: Session, authorization: str | None) -> APIKey:
    """The live key of a `Bearer <key>` header, or 401."""
    if not authorization:
        raise Unauthorized(
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
        )
    scheme, _, secret = authorization.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise Unauthorized("Malformed Authorization header; expected 'Bearer <key>'.")
    key = session.scalar(select(APIKey).where(APIKey.key_hash == hash_key(secret.strip())))
    if key is None or key.revoked_at is not None:
        raise Unauthorized("Incorrect API key provided.")
    return key
