"""Refuse NUL characters in the URL before they reach Postgres (text cannot hold them);
write a client's path into a log line only as `printable` makes it."""

from __future__ import annotations

from urllib.parse import unquote_to_bytes

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from batchwright.errors import InvalidRequest


def printable(text: str, limit: int = 200) -> str:
    """`text` for a log line: control characters (a `%0A` in a path decodes to a newline,
    which would start a forged log line) and other unprintables escaped, and bounded."""
    cut = text[:limit]
    if cut.isprintable():
        return cut
    return cut.encode("unicode_escape").decode("ascii")


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
