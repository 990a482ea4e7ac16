"""A stored file as a download: its content streamed, named by the base name it was
uploaded with. The name is the client's and may be anything: a path (`../../etc/passwd`
is sent as `passwd`), control characters, or text HTTP headers cannot carry (latin-1 only:
`日本語.jsonl` goes in RFC 6266's `filename*`, with an ASCII `filename` beside it)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from urllib.parse import quote

from fastapi.responses import StreamingResponse

from batchwright.db.models import File
from batchwright.db.session import get_sessionmaker
from batchwright.files.storage import iter_chunks

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_NOT_PLAIN = re.compile(r'[^\x20-\x7e]|["\\]')


def base_name(filename: str, fallback: str) -> str:
    name = _CONTROL.sub("", filename.replace("\\", "/")).rsplit("/", 1)[-1].strip()
    return fallback if name in ("", ".", "..") else name


def content_disposition(filename: str, fallback: str) -> str:
    name = base_name(filename, fallback)
    plain = _NOT_PLAIN.sub("_", name)
    if plain == name:
        return f'attachment; filename="{name}"'
    # surrogatepass: a name stored from a client's lone surrogate still percent-encodes.
    encoded = quote(name.encode("utf-8", "surrogatepass"), safe="")
    return f"attachment; filename=\"{plain}\"; filename*=UTF-8''{encoded}"


def file_response(file: File, media_type: str) -> StreamingResponse:
    file_id = file.id

    def body() -> Iterator[bytes]:
        # Its own session: the request's one is closed once the headers are out.
        with get_sessionmaker()() as stream_session:
            yield from iter_chunks(stream_session, file_id)

    return StreamingResponse(
        body(),
        media_type=media_type,
        headers={
            "Content-Length": str(file.bytes),
            "Content-Disposition": content_disposition(file.filename, f"{file.id}.jsonl"),
        },
    )
