"""File content as numbered chunks in the database: written and read a chunk at a time."""

from __future__ import annotations

from collections.abc import Iterator

from sqlalchemy import select
from sqlalchemy.orm import Session

from batchwright.db.models import File, FileChunk


class ChunkWriter:
    """Buffers bytes into fixed-size chunk rows; memory stays at one chunk."""

    def __init__(self, session: Session, file: File, chunk_bytes: int) -> None:
        self.session = session
        self.file = file
        self.chunk_bytes = chunk_bytes
        self.buffer = bytearray()
        self.seq = 0
        self.size = 0

    def write(self, data: bytes) -> None:
        self.buffer += data
        self.size += len(data)
        while len(self.buffer) >= self.chunk_bytes:
            self._flush(bytes(self.buffer[: self.chunk_bytes]))
            del self.buffer[: self.chunk_bytes]

    def _flush(self, data: bytes) -> None:
        chunk = FileChunk(file_id=self.file.id, seq=self.seq, data=data)
        self.session.add(chunk)
        # Flush and forget the chunk so memory holds one chunk, not the whole file.
        self.session.flush()
        self.session.expunge(chunk)
        self.seq += 1

    def close(self) -> File:
        if self.buffer:
            self._flush(bytes(self.buffer))
            self.buffer.clear()
        self.file.bytes = self.size
        self.session.flush()
        return self.file


def iter_chunks(session: Session, file_id: str) -> Iterator[bytes]:
    """One query per chunk, so only one chunk is ever held in memory."""
    seq = 0
    while True:
        data = session.scalar(
            select(FileChunk.data).where(FileChunk.file_id == file_id, FileChunk.seq == seq)
        )
        if data is None:
            return
        yield bytes(data)
        seq += 1


def iter_lines(session: Session, file_id: str, max_line_bytes: int) -> Iterator[bytes | None]:
    """Physical lines (without the newline), split across chunk boundaries.

    A line longer than max_line_bytes comes out as None (its bytes are not kept), so one
    enormous line cannot hold the whole file in memory.
    """
    buf = bytearray()
    oversized = False
    for chunk in iter_chunks(session, file_id):
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end == -1 else chunk[start:end]
            if not oversized:
                buf += piece
                if len(buf) > max_line_bytes:
                    oversized = True
                    buf.clear()
            if end == -1:
                break
            yield None if oversized else bytes(buf)
            buf.clear()
            oversized = False
            start = end + 1
    if buf or oversized:
        yield None if oversized else bytes(buf)
