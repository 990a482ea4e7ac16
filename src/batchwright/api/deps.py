"""Request-scoped dependencies: a session that commits, the caller's project."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Header, Request
from sqlalchemy.orm import Session

from batchwright.auth.service import authenticate
from batchwright.config import Settings, get_settings
from batchwright.db.session import session_scope


def get_session() -> Iterator[Session]:
    """Commit when the endpoint returns, before the response is sent; then send tasks."""
    with session_scope() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session, scope="function")]
SettingsDep = Annotated[Settings, Depends(get_settings)]


def current_project(
    request: Request, session: SessionDep, authorization: Annotated[str | None, Header()] = None
) -> str:
    checked: str | None = request.scope.get("state", {}).get("project_id")
    if checked is not None:  # the body guard checked the key before reading the body
        return checked
    return authenticate(session, authorization)


ProjectDep = Annotated[str, Depends(current_project)]
