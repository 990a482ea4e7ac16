"""File content in chunk rows: lines come back whole across chunk boundaries, in one pass,
and an over-long line is reported instead of held (SQLite, the embedded database)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    from batchwright.config import get_settings
    from batchwright.db.migrate import upgrade_head
    from batchwright.db.session import get_engine, get_sessionmaker, session_scope

    url = f"sqlite:///{tmp_path / 'db.sqlite3'}"
    monkeypatch.setenv("BATCHWRIGHT_DATABASE_URL", url)
    for cached in (get_settings, get_sessionmaker, get_engine):
        cached.cache_clear()
    upgrade_head()
    with session_scope() as s:
        yield s
    get_engine().dispose()
    for cached in (get_settings, get_sessionmaker, get_engine):
        cached.cache_clear()


def _store(session: object, data: bytes, chunk: int) -> str:
    from batchwright.auth.service import get_or_create_project
    from batchwright.files.service import new_file
    from batchwright.files.storage import ChunkWriter

    project = get_or_create_project(session, "p")  # type: ignore[arg-type]
    file = new_file(session, project.id, "x.jsonl", "batch")  # type: ignore[arg-type]
    writer = ChunkWriter(session, file, chunk)  # type: ignore[arg-type]
    for i in range(0, len(data), 3):  # odd write sizes against the chunk size
        writer.write(data[i : i + 3])
    assert writer.close().bytes == len(data)
    return file.id


@pytest.mark.parametrize("chunk", [1, 4, 7, 1024])
def test_lines_cross_chunk_boundaries(session: object, chunk: int) -> None:
    from batchwright.files.storage import iter_chunks, iter_lines

    data = b"a\nbb\n" + b"x" * 25 + b"\n\nlast"
    file_id = _store(session, data, chunk)
    assert b"".join(iter_chunks(session, file_id)) == data  # type: ignore[arg-type]
    assert list(iter_lines(session, file_id, 100)) == data.split(b"\n")  # type: ignore[arg-type]


def test_over_long_line_is_reported_not_kept(session: object) -> None:
    from batchwright.files.storage import iter_lines

    file_id = _store(session, b"ok\n" + b"y" * 50 + b"\nafter\n" + b"z" * 30, 8)
    assert list(iter_lines(session, file_id, 20)) == [b"ok", None, b"after", None]  # type: ignore[arg-type]
