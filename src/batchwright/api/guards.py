"""Refuse NUL characters in the URL before they reach Postgres (text cannot hold them)."""

from __future__ import annotations

from urllib.parse import unquote_to_bytes

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from batchwright.errors import InvalidRequest


class RejectNulInURL:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            raw = scope.get("raw_path") or scope["path"].encode()
            query = scope.get("query_string", b"")
            if b"\x00" in unquote_to_bytes(raw) or b"\x00" in unquote_to_bytes(query):
                err = InvalidRequest("NUL characters are not allowed in the URL.")
                body = orjson.dumps(err.body())
                await send(
                    {
                        "type": "http.response.start",
                        "status": err.status_code,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
