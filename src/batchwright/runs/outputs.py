"""Output and error files that never mislead: written under a temporary name and renamed
when complete, and an earlier run's file is removed rather than left beside fresh results."""

from __future__ import annotations

import os
from pathlib import Path

from batchwright.db.session import session_scope
from batchwright.files.storage import iter_chunks
from batchwright.runs.interrupt import Interrupt
from batchwright.runs.state import InputProblem


def default_paths(input_path: Path) -> tuple[Path, Path]:
    stem = input_path.name.removesuffix(".jsonl")
    return (
        input_path.with_name(f"{stem}.output.jsonl"),
        input_path.with_name(f"{stem}.errors.jsonl"),
    )


def check_paths(input_path: Path, output: Path, errors: Path) -> None:
    """Before any work and before anything is removed: both files can be written where asked
    (a typo in --output must not cost a whole run, nor the last run's files)."""
    if output.resolve() == errors.resolve():
        raise InputProblem(f"--output and --errors are the same file ({output})")
    for flag, path in (("--output", output), ("--errors", errors)):
        if path.resolve() == input_path.resolve():
            raise InputProblem(f"{flag} {path} is the input file itself")
        if path.is_dir():
            raise InputProblem(f"{flag} {path} is a directory; give a file name")
        folder = path.parent
        if not folder.is_dir():
            raise InputProblem(f"{flag} {path}: the folder {folder} does not exist")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise InputProblem(f"{flag} {path}: the folder {folder} is not writable")


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
