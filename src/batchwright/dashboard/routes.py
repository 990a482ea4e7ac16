"""Dashboard pages: sign in, batches, one batch (errors, downloads, cancel), files, service."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from sqlalchemy import or_, select

from batchwright.api.deps import SessionDep, SettingsDep
from batchwright.batches import service as batches
from batchwright.dashboard import auth, usage, views
from batchwright.db.base import now
from batchwright.db.models import Batch, File
from batchwright.errors import APIError, Unauthorized
from batchwright.files import service as files
from batchwright.files.download import file_response

HERE = Path(__file__).parent
templates = Jinja2Templates(directory=HERE / "templates")
templates.env.globals.update(stamp=views.stamp, duration=views.duration)
static = StaticFiles(directory=HERE / "static")
router = APIRouter(prefix=auth.PATH, include_in_schema=False)

NOTICES = {
    "cancelling": "Cancelling: lines already running finish, the rest are cancelled.",
    "not_cancellable": "This batch can no longer be cancelled.",
}


def _login() -> Response:
    return RedirectResponse(f"{auth.PATH}/login", status_code=303)


def _page(request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
    context.setdefault("csrf", auth.csrf_token(request))
    return templates.TemplateResponse(request, name, context, status_code=status)


@router.get("")
def home() -> Response:
    return RedirectResponse(f"{auth.PATH}/batches", status_code=303)


@router.get("/login")
def login_form(request: Request) -> HTMLResponse:
    return _page(request, "login.html", error=None)


@router.post("/login")
def login(
    request: Request, session: SessionDep, settings: SettingsDep, key: Annotated[str, Form()] = ""
) -> Response:
    resp = RedirectResponse(f"{auth.PATH}/batches", status_code=303)
    try:
        auth.sign_in(session, request, resp, key.strip(), settings)
    except Unauthorized as exc:
        return _page(request, "login.html", status=401, error=exc.message)
    return resp


@router.post("/logout")
def logout(request: Request, session: SessionDep) -> Response:
    resp = RedirectResponse(f"{auth.PATH}/login", status_code=303)
    auth.sign_out(session, request, resp)
    return resp


@router.get("/batches")
def batch_list(request: Request, session: SessionDep) -> Response:
    project = auth.signed_in_project(request, session)
    if project is None:
        return _login()
    rows = session.scalars(
        select(Batch)
        .where(Batch.project_id == project)
        .order_by(Batch.created_at.desc(), Batch.id.desc())
        .limit(100)
    )
    items = [views.batch_view(b) for b in rows]
    return _page(
        request,
        "batches.html",
        items=items,
        online=usage.online_usage(session, project),
        live=any(i.live for i in items),
        tab="batches",
    )


@router.get("/batches/{batch_id}")
def batch_page(batch_id: str, request: Request, session: SessionDep) -> Response:
    project = auth.signed_in_project(request, session)
    if project is None:
        return _login()
    batch = batches.get_batch(session, project, batch_id)
    view = views.batch_view(batch)
    notice = request.query_params.get("notice", "")
    if notice == "cancelling" and batch.status != "cancelling":
        # The page refreshes itself at the same address: once the batch is cancelled (or
        # ended otherwise) the banner would say "Cancelling" for good.
        notice = ""
    return _page(
        request,
        "batch.html",
        item=view,
        errors=views.line_errors(session, batch),
        live=view.live,
        notice=NOTICES.get(notice),
        tab="batches",
    )


@router.post("/batches/{batch_id}/cancel")
def cancel(
    batch_id: str, request: Request, session: SessionDep, csrf: Annotated[str, Form()] = ""
) -> Response:
    project = auth.signed_in_project(request, session)
    if project is None or not auth.csrf_ok(request, csrf):
        return _login()
    notice = "cancelling"
    try:
        batches.cancel_batch(session, project, batch_id)
    except APIError:
        notice = "not_cancellable"
    return RedirectResponse(f"{auth.PATH}/batches/{batch_id}?notice={notice}", status_code=303)


@router.get("/files")
def file_list(request: Request, session: SessionDep) -> Response:
    project = auth.signed_in_project(request, session)
    if project is None:
        return _login()
    rows = session.scalars(
        select(File)
        .where(
            File.project_id == project,
            or_(File.expires_at.is_(None), File.expires_at > now()),
        )
        .order_by(File.created_at.desc(), File.id.desc())
        .limit(200)
    )
    return _page(request, "files.html", files=list(rows), live=False, tab="files")


@router.get("/files/{file_id}/download")
def download(file_id: str, request: Request, session: SessionDep) -> Response:
    project = auth.signed_in_project(request, session)
    if project is None:
        return _login()
    return file_response(files.get_file(session, project, file_id), "application/jsonl")


@router.get("/service")
def service_page(request: Request, session: SessionDep, settings: SettingsDep) -> Response:
    project = auth.signed_in_project(request, session)
    if project is None:
        return _login()
    return _page(
        request,
        "service.html",
        queues=views.queue_depth(session),
        workers=views.workers(session, settings),
        live=True,
        tab="service",
    )
