"""The embedded default: one JSONL file, no servers, the service's own code paths.

SQLite stands in for Postgres and an in-process queue for the broker; the batch goes
through the same create -> validate -> process -> finalize functions the workers run.
The database is the run's state (runs/state.py): an interrupted run leaves it behind and
the same command continues from it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from sqlalchemy import case, select, update

from batchwright.auth.service import get_or_create_project
from batchwright.batches import service
from batchwright.config import Settings, get_settings
from batchwright.controlplane.dispatch import (
    VALIDATE,
    InlineDispatcher,
    set_dispatcher,
)
from batchwright.db.base import now
from batchwright.db.migrate import upgrade_head
from batchwright.db.models import Batch, BatchRequest
from batchwright.db.session import session_scope
from batchwright.files.service import new_file
from batchwright.files.storage import ChunkWriter
from batchwright.protocol.batches import BatchObject, CreateBatch
from batchwright.protocol.endpoints import file_endpoint
from batchwright.runs.interrupt import Interrupt
from batchwright.runs.models import preload
from batchwright.runs.outputs import check_paths, default_paths, export
from batchwright.runs.progress import LiveCounts, RunView
from batchwright.runs.state import READ_BYTES, RunState, inspect_input
from batchwright.runs.worker import InlineWorker, finished
from batchwright.webhooks import outbox

POLL_SECONDS = 0.1
# The database is read this often for the status; counts come from the worker thread.
STATUS_SECONDS = 0.5


@dataclass
class RunResult:
    batch: BatchObject
    output_path: Path | None
    error_path: Path | None


class RunInterrupted(Exception):
    def __init__(self, code: int, done: int, total: int) -> None:
        super().__init__(f"interrupted at {done} of {total} lines")
        self.code, self.done, self.total = code, done, total


def _start(state: RunState, input_path: Path, sha256: str, settings: Settings) -> str:
    state.create()
    upgrade_head()
    with session_scope() as session:
        project = get_or_create_project(session, "local")
        file = new_file(session, project.id, input_path.name, "batch")
        writer = ChunkWriter(session, file, settings.file_chunk_bytes)
        with input_path.open("rb") as src:
            while data := src.read(READ_BYTES):
                writer.write(data)
        writer.close()
        batch = service.create_batch(
            session,
            project.id,
            CreateBatch(
                input_file_id=file.id,
                endpoint=file_endpoint(input_path),
                completion_window="24h",
            ),
            settings,
        )
        batch_id, project_id = batch.id, project.id
    state.write_meta(sha256=sha256, batch_id=batch_id, project_id=project_id)
    return batch_id


def _resume(batch_id: str, settings: Settings, dispatcher: InlineDispatcher) -> Batch | None:
    """Pick an interrupted batch up: rows the last process held go back to the queue with
    their attempt refunded (being interrupted is not the line's fault), and the window
    restarts, so a run continued a day later does not expire."""
    upgrade_head()
    with session_scope() as session:
        batch = session.get(Batch, batch_id)
        if batch is None:
            return None
        session.execute(
            update(BatchRequest)
            .where(BatchRequest.batch_id == batch_id, BatchRequest.state == "running")
            .values(
                state="queued",
                lease_token=None,
                lease_expires_at=None,
                attempts=case((BatchRequest.attempts > 0, BatchRequest.attempts - 1), else_=0),
            )
        )
        if batch.status not in ("completed", "failed", "cancelled", "expired"):
            batch.expires_at = now() + settings.completion_window_seconds
            batch.updated_at = time.time()
        if batch.status == "validating":
            dispatcher.send(VALIDATE, batch_id)
        return batch


@dataclass(frozen=True)
class RunOptions:
    output: Path | None = None  # default: beside the input, FILE.output.jsonl
    errors: Path | None = None  # default: beside the input, FILE.errors.jsonl
    keep_state: bool = False
    restart: bool = False
    show_progress: bool = True


def run_file(
    input_path: Path,
    options: RunOptions | None = None,
    *,
    console: Console | None = None,
    interrupt: Interrupt | None = None,
) -> RunResult:
    options = options or RunOptions()
    default_output, default_errors = default_paths(input_path)
    check_paths(input_path, options.output or default_output, options.errors or default_errors)
    settings = get_settings()
    outbox.install()  # the service's own code paths, its hooks included
    info = inspect_input(input_path)
    console = console or Console(stderr=True, highlight=False)
    interrupt = interrupt or Interrupt()
    # A model the engine refuses is known before the run touches any state.
    if not preload(input_path, console, interrupt, show_progress=options.show_progress):
        raise RunInterrupted(interrupt.code, 0, info.lines)
    state = RunState(settings.home, input_path)
    state.acquire()
    try:
        run = _Run(input_path, options, console, interrupt, settings, state)
        return run.execute(info.sha256, info.lines)
    finally:
        state.release()


@dataclass
class _Run:
    input_path: Path
    options: RunOptions
    console: Console
    interrupt: Interrupt
    settings: Settings
    state: RunState

    def _batch(self, sha256: str, dispatcher: InlineDispatcher) -> str:
        """The batch to run: the saved one if it is for this very input, else a new one."""
        state, console = self.state, self.console
        meta = state.meta()
        if self.options.restart and state.dir.exists():
            console.print("--restart: discarding the saved state of an earlier run", markup=False)
            meta = None
        elif meta is not None and meta.get("sha256") != sha256:
            console.print(
                f"{self.input_path} changed since the interrupted run; starting over",
                markup=False,
            )
            meta = None
        if not self.settings.database_url:
            self.settings.database_url = f"sqlite:///{state.database}"
        batch = None if meta is None else _resume(str(meta["batch_id"]), self.settings, dispatcher)
        if batch is None:
            return _start(state, self.input_path, sha256, self.settings)  # VALIDATE queued
        if batch.total and batch.status not in ("validating", "completed", "failed"):
            done, _ = finished(batch.id)
            console.print(
                f"continuing: {done} of {batch.total} lines already done (state: {state.dir})",
                markup=False,
            )
        return batch.id

    def execute(self, sha256: str, lines: int) -> RunResult:
        default_output, default_errors = default_paths(self.input_path)
        output = self.options.output or default_output
        errors = self.options.errors or default_errors
        # Whatever sits at the output paths now is from an earlier run: it must not look current.
        output.unlink(missing_ok=True)
        errors.unlink(missing_ok=True)
        dispatcher = InlineDispatcher()
        set_dispatcher(dispatcher)
        batch_id = self._batch(sha256, dispatcher)
        counts = LiveCounts()
        counts.rebase(*finished(batch_id))
        with RunView(self.console, enabled=self.options.show_progress) as view:
            worker = InlineWorker(dispatcher, counts, self.interrupt, view)
            thread = threading.Thread(target=worker.run, name="embedded-worker", daemon=True)
            thread.start()
            _watch(thread, batch_id, view, counts, self.interrupt)
        if self.interrupt.requested.is_set():
            raise _interrupted(batch_id, self.interrupt, lines)
        if worker.failures:
            raise worker.failures[0]
        with session_scope() as session:
            row = session.get(Batch, batch_id)
            assert row is not None
            wire = service.to_wire(row)
        result = RunResult(
            batch=wire,
            output_path=export(wire.output_file_id, output, self.interrupt),
            error_path=export(wire.error_file_id, errors, self.interrupt),
        )
        if wire.status in ("completed", "failed") and not self.options.keep_state:
            self.state.discard()
        return result


def _watch(
    thread: threading.Thread,
    batch_id: str,
    view: RunView,
    counts: LiveCounts,
    interrupt: Interrupt,
) -> None:
    status, total = "validating", 0
    next_read = 0.0
    while thread.is_alive():
        if interrupt.requested.is_set():
            view.note("stopping…")
            interrupt.wait_for_worker(thread)
            return
        thread.join(POLL_SECONDS)
        if time.monotonic() >= next_read:
            next_read = time.monotonic() + STATUS_SECONDS
            with session_scope() as session:
                row = session.execute(
                    select(Batch.status, Batch.total).where(Batch.id == batch_id)
                ).one()
            status, total = row.status, row.total
        view.update(status, total, counts)


def _interrupted(batch_id: str, interrupt: Interrupt, lines: int) -> RunInterrupted:
    done, _ = finished(batch_id)
    with session_scope() as session:
        total = session.scalar(select(Batch.total).where(Batch.id == batch_id)) or lines
    return RunInterrupted(interrupt.code, done, total)
