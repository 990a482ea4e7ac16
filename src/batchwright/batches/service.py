"""Batches: create, read, list, cancel. The lifecycle past creation is in lifecycle.py."""

from __future__ import annotations

import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from batchwright.batches import lifecycle
from batchwright.config import Settings
from batchwright.controlplane.dispatch import VALIDATE, enqueue
from batchwright.db.base import new_id, now
from batchwright.db.models import Batch
from batchwright.db.pagination import page
from batchwright.errors import Conflict, InvalidRequest, NotFound
from batchwright.files import expiry
from batchwright.files.service import get_file
from batchwright.protocol.batches import (
    BatchErrorItem,
    BatchErrors,
    BatchObject,
    BatchUsage,
    CreateBatch,
    ListObject,
    RequestCounts,
)
from batchwright.protocol.endpoints import ENDPOINTS

WINDOWS = {"24h"}


def create_batch(session: Session, project_id: str, req: CreateBatch, settings: Settings) -> Batch:
    if req.endpoint not in ENDPOINTS:
        raise InvalidRequest(
            f"Invalid value for 'endpoint': {req.endpoint[:64]!r}. "
            f"batchwright supports {', '.join(repr(e) for e in ENDPOINTS)}.",
            param="endpoint",
            code="invalid_value",
        )
    if req.completion_window not in WINDOWS:
        raise InvalidRequest(
            f"Invalid value for 'completion_window': {req.completion_window[:16]!r}. "
            "Supported: '24h'.",
            param="completion_window",
            code="invalid_value",
        )
    file = get_file(session, project_id, req.input_file_id)
    if file.purpose != "batch":
        raise InvalidRequest(
            f"File {file.id} has purpose {file.purpose!r}; a batch input needs purpose 'batch'.",
            param="input_file_id",
            code="invalid_value",
        )
    created = now()
    batch = Batch(
        id=new_id("batch_"),
        project_id=project_id,
        endpoint=req.endpoint,
        input_file_id=file.id,
        completion_window=req.completion_window,
        status="validating",
        created_at=created,
        expires_at=created + settings.completion_window_seconds,
        metadata_=req.metadata,
        output_expires_after=expiry.parse(req.output_expires_after, "output_expires_after"),
        total=0,
        completed=0,
        failed=0,
        input_tokens=0,
        output_tokens=0,
        updated_at=time.time(),
    )
    session.add(batch)
    session.flush()
    enqueue(session, VALIDATE, batch.id)
    return batch


def get_batch(session: Session, project_id: str, batch_id: str) -> Batch:
    batch = session.get(Batch, batch_id)
    if batch is None or batch.project_id != project_id:
        raise NotFound(f"No such Batch object: {batch_id[:64]}", param="batch_id")
    return batch


def list_batches(
    session: Session, project_id: str, *, after: str | None, limit: int
) -> ListObject[BatchObject]:
    cursor = get_batch(session, project_id, after) if after else None
    query = select(Batch).where(Batch.project_id == project_id)
    rows, has_more = page(session, Batch, query, cursor=cursor, limit=limit)
    data = [to_wire(b) for b in rows]
    return ListObject[BatchObject](
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=has_more,
    )


def cancel_batch(session: Session, project_id: str, batch_id: str) -> Batch:
    batch = get_batch(session, project_id, batch_id)
    # Lock so a cancel cannot interleave with validation or finalization of the same batch.
    session.refresh(batch, with_for_update=True)
    if batch.status in ("cancelling", "cancelled"):
        return batch
    if batch.status not in ("validating", "in_progress"):
        raise Conflict(
            f"Cannot cancel batch {batch.id}: its status is {batch.status!r}.",
            param="batch_id",
            code="batch_not_cancellable",
        )
    lifecycle.start_cancel(session, batch)
    return batch


def to_wire(batch: Batch) -> BatchObject:
    return BatchObject(
        id=batch.id,
        endpoint=batch.endpoint,
        model=batch.model,
        errors=BatchErrors(data=[BatchErrorItem(**e) for e in batch.errors])
        if batch.errors
        else None,
        input_file_id=batch.input_file_id,
        completion_window=batch.completion_window,
        status=batch.status,
        output_file_id=batch.output_file_id,
        error_file_id=batch.error_file_id,
        created_at=batch.created_at,
        in_progress_at=batch.in_progress_at,
        expires_at=batch.expires_at,
        finalizing_at=batch.finalizing_at,
        completed_at=batch.completed_at,
        failed_at=batch.failed_at,
        expired_at=batch.expired_at,
        cancelling_at=batch.cancelling_at,
        cancelled_at=batch.cancelled_at,
        request_counts=RequestCounts(
            total=batch.total, completed=batch.completed, failed=batch.failed
        ),
        metadata=batch.metadata_,
        usage=BatchUsage(
            input_tokens=batch.input_tokens,
            input_tokens_details={"cached_tokens": batch.cached_tokens},
            output_tokens=batch.output_tokens,
            total_tokens=batch.input_tokens + batch.output_tokens,
        ),
    )
