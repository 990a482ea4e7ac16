"""Signing in with an API key: the key lives in an HttpOnly, SameSite=Strict cookie and is
checked like a Bearer header on every page; forms carry a token derived from it (CSRF)."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request
from sqlalchemy.orm import Session

from batchwright.auth.service import authenticate
from batchwright.errors import Unauthorized

COOKIE = "bw_dashboard_key"
PATH = "/dashboard"


def signed_in_project(request: Request, session: Session) -> str | None:
    key = request.cookies.get(COOKIE)
    if not key:
        return None
    try:
        return authenticate(session, f"Bearer {key}")
    except Unauthorized:
        return None


def csrf_token(request: Request) -> str:
    key = request.cookies.get(COOKIE, "")
    return hashlib.sha256(f"dashboard-form:{key}".encode()).hexdigest()[:32]


def csrf_ok(request: Request, token: str) -> bool:
    return bool(request.cookies.get(COOKIE)) and hmac.compare_digest(csrf_token(request), token)
