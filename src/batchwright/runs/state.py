"""Where a `batchwright run` keeps its state: one folder per input under BATCHWRIGHT_HOME.

The folder is named for the input's absolute path, so running the same command again finds
it; it records the input's content hash, so an input edited since then starts over instead
of mixing old results with new lines. It holds the run's SQLite database and a small
meta.json written last (a folder without one is an unfinished start and is discarded).
"""

from __future__ import annotations

import codecs
import fcntl
import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

READ_BYTES = 1024 * 1024
META = "meta.json"
DATABASE = "state.sqlite3"


class InputProblem(Exception):
    """The input cannot be a JSONL batch file; the message is one plain sentence."""


class StateBusy(Exception):
    """Another `batchwright run` holds this input's state."""


@dataclass(frozen=True)
class InputInfo:
    sha256: str
    lines: int  # newline-separated lines, blank ones included


def inspect_input(path: Path) -> InputInfo:
    """Hash the file and check, in one streaming pass, that it is UTF-8 text."""
    digest = hashlib.sha256()
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    lines = 0
    last = b"\n"
    with path.open("rb") as src:
        while chunk := src.read(READ_BYTES):
            digest.update(chunk)
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                line = lines + chunk[: max(exc.start, 0)].count(b"\n") + 1
                raise InputProblem(
                    f"line {line} is not UTF-8 text — is this a JSONL file?"
                ) from None
            nul = chunk.find(b"\x00")
            if nul >= 0:
                line = lines + chunk[:nul].count(b"\n") + 1
                raise InputProblem(
                    f"line {line} holds binary data (a NUL byte) — is this a JSONL file?"
                )
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise InputProblem(f"line {lines + 1} is not UTF-8 text — is this a JSONL file?") from None
    if last != b"\n":
        lines += 1
    return InputInfo(sha256=digest.hexdigest(), lines=lines)


class RunState:
    """The state folder of one input, held under an exclusive lock while a run uses it."""

    def __init__(self, home: Path, input_path: Path) -> None:
        self.input = input_path.resolve()
        key = hashlib.sha256(str(self.input).encode()).hexdigest()[:16]
        runs = home / "runs"
        self.dir = runs / key
        self.database = self.dir / DATABASE
        self._lock_path = runs / f"{key}.lock"
        self._lock: IO[bytes] | None = None

    def acquire(self) -> None:
        self._lock_path.parent.mkdir(parents=True, exist_ok=True)
        fh = self._lock_path.open("ab")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            raise StateBusy(
                f"another `batchwright run` is working on {self.input}; wait for it or stop it"
            ) from None
        self._lock = fh

    def release(self) -> None:
        if self._lock is not None:
            # The lock file goes while we still hold it, so a waiting run never locks a
            # file that is about to disappear under it.
            self._lock_path.unlink(missing_ok=True)
            self._lock.close()
            self._lock = None

    def meta(self) -> dict[str, Any] | None:
        try:
            data = orjson.loads((self.dir / META).read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return None
        return data if isinstance(data, dict) else None

    def write_meta(self, **meta: Any) -> None:
        tmp = self.dir / (META + ".tmp")
        tmp.write_bytes(orjson.dumps({"input": str(self.input), **meta}))
        os.replace(tmp, self.dir / META)

    def discard(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def create(self) -> None:
        self.discard()
        self.dir.mkdir(parents=True)
