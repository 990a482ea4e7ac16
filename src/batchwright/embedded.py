"""The embedded default: one JSONL file, no servers, the service's own code paths.

SQLite stands in for Postgres and an in-process queue for the broker; the batch goes
through the same create -> validate -> process -> finalize functions the workers run.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from batchwright.auth.service import get_or_create_project
from batchwright.batches import service
from batchwright.config import Settings, get_settings
from batchwright.db.migrate import upgrade_head
from batchwright.db.models import Batch
from batchwright.db.session import session_scope
from batchwright.files.service import new_file
from batchwright.files.storage import ChunkWriter, iter_chunks
from batchwright.protocol.batches import BatchObject, CreateBatch
from batchwright.worker import runner
from batchwright.worker.dispatch import (
    FINALIZE,
    PROCESS,
    VALIDATE,
    InlineDispatcher,
    set_dispatcher,
)

READ_BYTES = 1024 * 1024


@dataclass
class RunResult:
    batch: BatchObject
    output_path: Path | None
    error_path: Path | None


def _drain(dispatcher: InlineDispatcher, failures: list[BaseException]) -> None:
    try:
        _run_queue(dispatcher)
    except BaseException as exc:  # surfaced by run_file in the main thread
        failures.append(exc)


def _run_queue(dispatcher: InlineDispatcher) -> None:
    tasks: dict[str, Callable[..., object]] = {
        VALIDATE: runner.validate_batch,
        PROCESS: runner.process,
        FINALIZE: runner.finalize_batch,
    }
    while dispatcher.queue:
        name, args = dispatcher.queue.popleft()
        tasks[name](*args)
    # Whatever a crash or a lost wake-up left behind, the sweeper's pass picks up.
    runner.sweep()
    while dispatcher.queue:
        name, args = dispatcher.queue.popleft()
        tasks[name](*args)


def _export(file_id: str | None, path: Path) -> Path | None:
    if file_id is None:
        return None
    with session_scope() as session, path.open("wb") as out:
        for chunk in iter_chunks(session, file_id):
            out.write(chunk)
    return path


def run_file(input_path: Path, *, show_progress: bool = True) -> RunResult:
    settings: Settings = get_settings()
    if not settings.database_url:
        # A throwaway database per run: results land as files next to the input.
        tmp = Path(tempfile.mkdtemp(prefix="batchwright-"))
        settings.database_url = f"sqlite:///{tmp / 'run.sqlite3'}"
    upgrade_head()
    dispatcher = InlineDispatcher()
    set_dispatcher(dispatcher)

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
            CreateBatch(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"),
            settings,
        )
        batch_id, project_id = batch.id, project.id

    failures: list[BaseException] = []
    worker = threading.Thread(
        target=_drain, args=(dispatcher, failures), name="embedded-worker", daemon=True
    )
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        disable=not show_progress,
    ) as progress:
        task = progress.add_task("validating", total=None)
        worker.start()
        while worker.is_alive():
            worker.join(timeout=0.25)
            with session_scope() as session:
                b = session.get(Batch, batch_id)
                assert b is not None
                progress.update(
                    task,
                    description=b.status,
                    total=b.total or None,
                    completed=b.completed + b.failed,
                )
    if failures:
        raise failures[0]
    with session_scope() as session:
        wire = service.to_wire(service.get_batch(session, project_id, batch_id))
    stem = input_path.name.removesuffix(".jsonl")
    return RunResult(
        batch=wire,
        output_path=_export(wire.output_file_id, input_path.with_name(f"{stem}.output.jsonl")),
        error_path=_export(wire.error_file_id, input_path.with_name(f"{stem}.errors.jsonl")),
    )
