"""Who may send an online request, and for which model: the key (before the body is
read), the project's rate limits (its own, else the deployment's defaults), the model in
the registry. Blocking (the database): the endpoint runs it in the thread pool."""

from __future__ import annotations

from dataclasses import dataclass

from batchwright.auth.service import authenticate_key
from batchwright.config import get_settings
from batchwright.db.models import Project
from batchwright.db.session import session_scope
from batchwright.online.ratelimit import Limits


@dataclass(frozen=True)
class Caller:
    project_id: str
    key_id: str
    limits: Limits


def admit(authorization: str | None) -> Caller:
    """The caller of a request, or Unauthorized (401)."""
    with session_scope() as session:
        key = authenticate_key(session, authorization)
        project = session.get(Project, key.project_id)
        settings = get_settings()
        limits = Limits(
            (project and project.online_requests_per_minute)
            or settings.online_default_requests_per_minute
            or None,
            (project and project.online_tokens_per_minute)
            or settings.online_default_tokens_per_minute
            or None,
        )
        return Caller(key.project_id, key.id, limits)
