"""A request body is read only from a caller that may send it, and never past a cap.

FastAPI reads and parses a JSON body before an endpoint's dependencies run, so a stranger's
300 MiB body was held and parsed before its key was looked at. This runs first: a /v1/
request with a body must carry a valid key (401 before a byte of it is read), and a body
over `max_json_body_bytes` is a 413 (by its Content-Length before reading, else as it
streams). A body under the cap is read here and handed on as it came. The upload streams
into storage under its own limit, and the online endpoint checks the key and caps its body
itself: both are left alone.
"""

from __future__ import annotations

import logging

import orjson
from sqlalchemy.exc import DBAPIError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from batchwright.api.guards import printable
from batchwright.auth.service import authenticate
from batchwright.config import get_settings
from batchwright.db.session import get_sessionmaker
from batchwright.errors import APIError, PayloadTooLarge, Unavailable

log = logging.getLogger(__name__)

NO_BODY = frozenset({"GET", "HEAD", "OPTIONS"})
# Routes that check the key and bound their body themselves (files/upload.py,
# online/endpoint.py): a body guard here would only ask for the key twice.
STREAMED = frozenset(
    {("POST", "/v1/files"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")}
)


def _project(authorization: str | None) -> str:
    try:
        with get_sessionmaker()() as session:
            return authenticate(session, authorization)
    except DBAPIError as exc:
        log.warning("database unavailable: %s", exc)
        raise Unavailable("The database is unavailable; retry the request.") from exc


async def _answer(send: Send, exc: APIError) -> None:
    """The error, and the connection closed after it: the body is left unread."""
    body = orjson.dumps(exc.body())
    await send(
        {
            "type": "http.response.start",
            "status": exc.status_code,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"The request body is over {limit} bytes (BATCHWRIGHT_MAX_JSON_BODY_BYTES).",
        code="request_too_large",
    )


class BodyGuard:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope.get("method", ""), scope.get("path", "")
        if scope["type"] != "http" or method in NO_BODY or (method, path.rstrip("/")) in STREAMED:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if path.startswith("/v1/"):
            try:
                project = await run_in_threadpool(_project, headers.get("authorization"))
            except APIError as exc:
                await _answer(send, exc)
                return
            # The endpoint's key dependency takes it from here instead of asking again.
            scope.setdefault("state", {})["project_id"] = project
        limit = get_settings().max_json_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await _answer(send, too_large(limit))
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                log.warning(
                    "%s %s: the client left before sending its whole body",
                    printable(method),
                    printable(path),
                )
                # Nobody reads it; an app that returns without answering is an error to
                # the middleware around this one.
                await send({"type": "http.response.start", "status": 400, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _answer(send, too_large(limit))
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        await self.app(scope, _replay(b"".join(chunks), receive), send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body in one message, then whatever the client does next (a disconnect)."""
    pending = True

    async def replay() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
