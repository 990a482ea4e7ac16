"""/v1/files"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from batchwright.api.deps import ProjectDep, SessionDep, SettingsDep
from batchwright.files import service
from batchwright.files.download import file_response
from batchwright.files.upload import receive_upload
from batchwright.protocol.batches import FileDeleted, FileObject, ListObject

router = APIRouter(prefix="/v1/files", tags=["files"])

UPLOAD_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": ["batch"]},
                    },
                }
            }
        },
    }
}


@router.post("", openapi_extra=UPLOAD_DOC)
async def create_file(
    request: Request, session: SessionDep, project: ProjectDep, settings: SettingsDep
) -> FileObject:
    file = await receive_upload(request, session, project, settings)
    return service.to_wire(file)


@router.get("")
def list_files(
    session: SessionDep,
    project: ProjectDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    purpose: str | None = None,
) -> ListObject[FileObject]:
    return service.list_files(
        session, project, after=after, limit=limit, order=order, purpose=purpose
    )


@router.get("/{file_id}")
def retrieve_file(file_id: str, session: SessionDep, project: ProjectDep) -> FileObject:
    return service.to_wire(service.get_file(session, project, file_id))


@router.delete("/{file_id}")
def delete_file(file_id: str, session: SessionDep, project: ProjectDep) -> FileDeleted:
    service.delete_file(session, project, file_id)
    return FileDeleted(id=file_id)


@router.get("/{file_id}/content", response_class=StreamingResponse)
def file_content(file_id: str, session: SessionDep, project: ProjectDep) -> StreamingResponse:
    return file_response(service.get_file(session, project, file_id), "application/octet-stream")
