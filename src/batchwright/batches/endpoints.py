"""/v1/batches"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from batchwright.api.deps import ProjectDep, SessionDep, SettingsDep
from batchwright.batches import service
from batchwright.protocol.batches import BatchObject, CreateBatch, ListObject

router = APIRouter(prefix="/v1/batches", tags=["batches"])


@router.post("")
def create_batch(
    body: CreateBatch, session: SessionDep, project: ProjectDep, settings: SettingsDep
) -> BatchObject:
    return service.to_wire(service.create_batch(session, project, body, settings))


@router.get("")
def list_batches(
    session: SessionDep,
    project: ProjectDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> ListObject[BatchObject]:
    return service.list_batches(session, project, after=after, limit=limit)


@router.get("/{batch_id}")
def retrieve_batch(batch_id: str, session: SessionDep, project: ProjectDep) -> BatchObject:
    return service.to_wire(service.get_batch(session, project, batch_id))


@router.post("/{batch_id}/cancel")
def cancel_batch(batch_id: str, session: SessionDep, project: ProjectDep) -> BatchObject:
    return service.to_wire(service.cancel_batch(session, project, batch_id))
