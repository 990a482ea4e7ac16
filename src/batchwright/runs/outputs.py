"""Output and error files that never mislead: written under a temporary name and renamed
when complete, and an earlier run's file is removed rather than left beside fresh results."""

from __future__ import annotations

import os
from pathlib import Path

from batchwright.db.session import session_scope
from batchwright.files.storage import iter_chunks
from batchwright.runs.interrupt import Interrupt


def default_paths(input_path: Path) -> tuple[Path, Path]:
    stem = input_path.name.removesuffix(".jsonl")
    return (
        input_path.with_name(f"{stem}.output.jsonl"),
        input_path.with_name(f"{stem}.errors.jsonl"),
    )


def export(file_id: str | None, path: Path, interrupt: Interrupt) -> Path | None:
    """Write a stored file to `path` atomically; with no file, remove what `path` holds."""
    if file_id is None:
        path.unlink(missing_ok=True)
        return None
    tmp = path.with_name(f".{path.name}.partial")
    interrupt.temp_files.add(tmp)
    try:
        with session_scope() as session, tmp.open("wb") as out:
            for chunk in iter_chunks(session, file_id):
                out.write(chunk)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        interrupt.temp_files.discard(tmp)
    return path
