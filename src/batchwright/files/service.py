"""Files: create (streamed), list, get, delete. Services flush, never commit."""

from __future__ import annotations

from sqlalchemy import delete, or_, select
from sqlalchemy.orm import Session

from batchwright.db.base import new_id, now
from batchwright.db.models import File, FileChunk
from batchwright.db.pagination import page
from batchwright.errors import InvalidRequest, NotFound
from batchwright.files.expiry import is_expired
from batchwright.protocol.batches import FileObject, ListObject

UPLOAD_PURPOSES = {"batch"}
LIST_PURPOSES = {"batch", "batch_output"}


def new_file(session: Session, project_id: str, filename: str, purpose: str) -> File:
    file = File(
        id=new_id("file-"),
        project_id=project_id,
        filename=filename,
        purpose=purpose,
        bytes=0,
        created_at=now(),
    )
    session.add(file)
    session.flush()
    return file


def check_purpose(purpose: str | None) -> str:
    if not purpose:
        raise InvalidRequest(
            "Missing required parameter: 'purpose'.",
            param="purpose",
            code="missing_required_parameter",
        )
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidRequest(
            f"Invalid value for 'purpose': {purpose[:64]!r}. batchwright accepts only 'batch'.",
            param="purpose",
            code="invalid_value",
        )
    return purpose


def get_file(session: Session, project_id: str, file_id: str) -> File:
    file = session.get(File, file_id)
    # An expired file is gone for clients at once, before the purge removes its content.
    if file is None or file.project_id != project_id or is_expired(file):
        raise NotFound(f"No such File object: {file_id[:64]}", param="file_id")
    return file


def list_files(
    session: Session,
    project_id: str,
    *,
    after: str | None,
    limit: int,
    order: str,
    purpose: str | None,
) -> ListObject[FileObject]:
    query = select(File).where(
        File.project_id == project_id, or_(File.expires_at.is_(None), File.expires_at > now())
    )
    if purpose:
        query = query.where(File.purpose == purpose)
    cursor = get_file(session, project_id, after) if after else None
    rows, has_more = page(session, File, query, cursor=cursor, limit=limit, desc=order == "desc")
    data = [to_wire(f) for f in rows]
    return ListObject[FileObject](
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=has_more,
    )


def delete_file(session: Session, project_id: str, file_id: str) -> None:
    file = get_file(session, project_id, file_id)
    # Explicit chunk delete: SQLite only cascades with the foreign_keys pragma on.
    session.execute(delete(FileChunk).where(FileChunk.file_id == file.id))
    session.delete(file)
    session.flush()


def to_wire(file: File) -> FileObject:
    return FileObject(
        id=file.id,
        bytes=file.bytes,
        created_at=file.created_at,
        filename=file.filename,
        purpose=file.purpose,
        expires_at=file.expires_at,
    )
