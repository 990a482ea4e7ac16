"""Purge expired files: content rows go a bounded number per transaction, then the row.

Clients stop seeing a file the moment it expires (files.service filters on expires_at);
this only reclaims the storage. Each step is a short transaction that skips files another
transaction holds (validation share-locks its input), so the purge never waits on anyone
and nobody waits on it. The sweeper only notices that work exists and sends a task.
"""

from __future__ import annotations

import logging

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from batchwright.config import Settings, get_settings
from batchwright.controlplane.dispatch import Dispatcher
from batchwright.db.base import now
from batchwright.db.models import File, FileChunk
from batchwright.db.session import session_scope

log = logging.getLogger(__name__)

PURGE = "batchwright.purge_files"
FILES_PER_STEP = 8


def purge_step(session: Session, chunk_limit: int) -> tuple[int, int]:
    """Remove up to chunk_limit chunks of expired files; returns (chunks, files) removed."""
    files = list(
        session.scalars(
            select(File.id)
            .where(File.expires_at <= now())
            .order_by(File.expires_at)
            .limit(FILES_PER_STEP)
            .with_for_update(skip_locked=True)
        )
    )
    chunks = removed = 0
    for file_id in files:
        budget = chunk_limit - chunks
        if budget <= 0:
            break
        seqs = select(FileChunk.seq).where(FileChunk.file_id == file_id).limit(budget)
        chunks += session.execute(
            delete(FileChunk).where(FileChunk.file_id == file_id, FileChunk.seq.in_(seqs))
        ).rowcount  # type: ignore[attr-defined]
        left = session.scalar(select(func.count()).where(FileChunk.file_id == file_id))
        if not left:
            session.execute(delete(File).where(File.id == file_id))
            removed += 1
    return chunks, removed


def purge(settings: Settings | None = None) -> tuple[int, int, bool]:
    """A bounded number of steps; returns (chunks, files, more left) so the caller re-sends."""
    settings = settings or get_settings()
    chunks = files = 0
    for _ in range(settings.purge_steps_per_task):
        with session_scope() as session:
            step_chunks, step_files = purge_step(session, settings.purge_chunks_per_step)
        chunks, files = chunks + step_chunks, files + step_files
        if step_chunks == 0 and step_files == 0:
            return chunks, files, False
    if files:
        log.info("purged %d expired files (%d chunks)", files, chunks)
    return chunks, files, True


def has_expired(session: Session) -> bool:
    return session.scalar(select(File.id).where(File.expires_at <= now()).limit(1)) is not None


def kick(dispatcher: Dispatcher) -> None:
    """Called by the sweeper: one indexed look-up, and a task when there is work."""
    settings = get_settings()
    with session_scope() as session:
        pending = has_expired(session)
    if not pending:
        return
    if settings.embedded:
        purge(settings)  # no task queue in the embedded default: a bounded pass in-line
    else:
        dispatcher.send(PURGE)
