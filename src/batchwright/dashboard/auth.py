"""Signing in: the API key opens a server-side session (auth/sessions.py) and the cookie
holds only its random token (HttpOnly, SameSite=Strict, Secure over HTTPS), so a cookie
that leaks is no key to the API and dies with the session. Forms carry a token derived
from the session's (CSRF)."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request, Response
from sqlalchemy.orm import Session

from batchwright.auth.sessions import close_session, open_session, session_project
from batchwright.config import Settings

COOKIE = "bw_dashboard_session"
PATH = "/dashboard"


def sign_in(
    session: Session, request: Request, response: Response, key: str, settings: Settings
) -> None:
    """Open a session for `key` (Unauthorized if it is not live) and set its cookie."""
    token = open_session(session, key, settings.dashboard_session_seconds)
    response.set_cookie(
        COOKIE, token, max_age=settings.dashboard_session_seconds, path=PATH, httponly=True,
        samesite="strict", secure=request.url.scheme == "https",  # the proxy's, if trusted
    )  # fmt: skip


def sign_out(session: Session, request: Request, response: Response) -> None:
    token = request.cookies.get(COOKIE)
    if token:
        close_session(session, token)
    response.delete_cookie(COOKIE, path=PATH)


def signed_in_project(request: Request, session: Session) -> str | None:
    token = request.cookies.get(COOKIE)
    return session_project(session, token) if token else None


def csrf_token(request: Request) -> str:
    token = request.cookies.get(COOKIE, "")
    return hashlib.sha256(f"dashboard-form:{token}".encode()).hexdigest()[:32]


def csrf_ok(request: Request, token: str) -> bool:
    return bool(request.cookies.get(COOKIE)) and hmac.compare_digest(csrf_token(request), token)
