"""The body of an online request, read only after the key was checked and never past the
cap: a body over it is a 413 before it is held in memory."""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request

from batchwright.api.body_guard import too_large


class ClientGone(Exception):
    """The client left while sending its body."""


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)
