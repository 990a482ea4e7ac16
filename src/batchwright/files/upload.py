"""Streaming multipart upload: the `file` part goes to chunk rows as it arrives.

Starlette's form parser spools the whole part before the endpoint runs; this one counts
bytes while reading, so an upload over the limit is refused mid-stream and, being one
transaction, leaves nothing behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import python_multipart
from fastapi import Request
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from batchwright.config import Settings
from batchwright.db.models import File
from batchwright.errors import InvalidRequest, PayloadTooLarge
from batchwright.files.expiry import apply_upload_expiry
from batchwright.files.service import check_purpose, new_file
from batchwright.files.storage import ChunkWriter

MAX_FIELD_BYTES = 4096
# Non-file form fields (purpose is the only one read) and header bytes per part: memory
# per request is bounded by these whatever the client streams.
MAX_FIELDS = 16
MAX_HEADER_BYTES = 16 * 1024
# Multipart framing and small fields on top of the file itself.
ENVELOPE_SLACK = 64 * 1024


@dataclass
class _Part:
    headers: dict[bytes, bytes] = field(default_factory=dict)
    name: str = ""
    filename: str | None = None
    data: bytearray = field(default_factory=bytearray)


class _Collector:
    """Parser callbacks: queue file bytes for the writer, keep small fields in memory."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.part = _Part()
        self.header_name = b""
        self.header_value = b""
        self.fields: dict[str, str] = {}
        self.file_name: str | None = None
        self.file_parts = 0
        self.file_bytes = 0
        self.pending: list[bytes] = []
        self.parts = 0
        self.header_bytes = 0
        self.ended = False

    def on_part_begin(self) -> None:
        self.part = _Part()
        self.header_bytes = 0
        self.parts += 1
        if self.parts > MAX_FIELDS + 1:
            raise InvalidRequest(
                f"Too many form fields: at most {MAX_FIELDS} besides 'file'.", param="file"
            )

    def _count_header(self, n: int) -> None:
        self.header_bytes += n
        if self.header_bytes > MAX_HEADER_BYTES:
            raise InvalidRequest(
                f"A multipart part's headers are longer than {MAX_HEADER_BYTES} bytes."
            )

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._count_header(end - start)
        self.header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._count_header(end - start)
        self.header_value += data[start:end]

    def on_header_end(self) -> None:
        self.part.headers[self.header_name.lower()] = self.header_value
        self.header_name, self.header_value = b"", b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self.part.headers.get(b"content-disposition", b""))
        self.part.name = options.get(b"name", b"").decode("utf-8", "replace")
        if b"filename" in options and self.part.name == "file":
            name = options[b"filename"].decode("utf-8", "replace").replace("\x00", "")
            self.part.filename = name[:512] or "upload.jsonl"
            self.file_name = self.part.filename
            self.file_parts += 1
            if self.file_parts > 1:
                raise InvalidRequest("Send exactly one 'file' part.", param="file")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if self.part.filename is not None:
            self.file_bytes += len(chunk)
            if self.file_bytes > self.limit:
                raise PayloadTooLarge(
                    f"File is larger than the {self.limit} byte limit.", param="file"
                )
            self.pending.append(chunk)
        else:
            self.part.data += chunk
            if len(self.part.data) > MAX_FIELD_BYTES:
                raise InvalidRequest(f"Field {self.part.name!r} is too long.", param=self.part.name)

    def on_part_end(self) -> None:
        if self.part.filename is None and self.part.name:
            self.fields[self.part.name] = self.part.data.decode("utf-8", "replace")

    def on_end(self) -> None:
        self.ended = True


async def receive_upload(
    request: Request, session: Session, project_id: str, settings: Settings
) -> File:
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or b"boundary" not in params:
        raise InvalidRequest(
            "Send the file as multipart/form-data with a 'file' field.", param="file"
        )
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > settings.max_upload_bytes + ENVELOPE_SLACK:
        raise PayloadTooLarge(f"File is larger than the {settings.max_upload_bytes} byte limit.")

    collector = _Collector(settings.max_upload_bytes)
    callbacks = {
        name: getattr(collector, name) for name in dir(collector) if name.startswith("on_")
    }
    try:
        parser = python_multipart.MultipartParser(params[b"boundary"], callbacks)  # type: ignore[arg-type]
    except FormParserError as exc:  # e.g. a boundary over 256 characters
        raise InvalidRequest(f"Malformed multipart body: {exc}.", param="file") from exc
    writer: ChunkWriter | None = None

    def drain() -> None:
        nonlocal writer
        if writer is None:
            if "purpose" in collector.fields:  # clients usually send it first: fail early
                check_purpose(collector.fields["purpose"])
            # The row exists before its chunks; purpose is checked once the fields are in.
            file = new_file(session, project_id, collector.file_name or "upload.jsonl", "batch")
            writer = ChunkWriter(session, file, settings.file_chunk_bytes)
        for data in collector.pending:
            writer.write(data)
        collector.pending.clear()

    # A streamed (chunked) body has no Content-Length to check up front: count as it comes.
    budget = settings.max_upload_bytes + ENVELOPE_SLACK
    received = 0
    try:
        async for data in request.stream():
            received += len(data)
            if received > budget:
                raise PayloadTooLarge(
                    f"Request body is larger than the {settings.max_upload_bytes} byte limit."
                )
            parser.write(data)
            if collector.pending:
                await run_in_threadpool(drain)
        parser.finalize()
    except FormParserError as exc:
        raise InvalidRequest(f"Malformed multipart body: {exc}") from exc
    if not collector.ended:
        # Without its closing boundary the body was cut short: storing it would keep a
        # truncated file. The transaction rolls back, so nothing written so far stays.
        raise InvalidRequest(
            "Malformed multipart body: it ends before the closing boundary.", param="file"
        )
    if collector.file_name is None:
        raise InvalidRequest(
            "Missing required parameter: 'file'.", param="file", code="missing_required_parameter"
        )
    check_purpose(collector.fields.get("purpose"))
    if collector.file_bytes == 0:
        raise InvalidRequest("The uploaded file is empty.", param="file", code="empty_file")
    await run_in_threadpool(drain)
    assert writer is not None
    apply_upload_expiry(writer.file, collector.fields, settings)
    return await run_in_threadpool(writer.close)
