"""Webhook endpoints of a project: add (secret returned once), list, remove."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from batchwright.auth.service import get_or_create_project
from batchwright.config import Settings
from batchwright.db.base import new_id, now
from batchwright.db.models import Project, WebhookEndpoint
from batchwright.errors import InvalidRequest, NotFound
from batchwright.webhooks.signing import new_secret
from batchwright.webhooks.targets import check_url

EVENT_TYPES = ("batch.completed", "batch.failed", "batch.expired", "batch.cancelled")


def add_endpoint(
    session: Session,
    project_name: str,
    url: str,
    settings: Settings,
    events: Sequence[str] | None = None,
) -> WebhookEndpoint:
    check_url(url, allow_private=settings.webhook_allow_private_targets)
    unknown = sorted(set(events or ()) - set(EVENT_TYPES))
    if unknown:
        raise InvalidRequest(
            f"Unknown event types {unknown}; choose from {list(EVENT_TYPES)}.",
            param="event_types",
            code="invalid_value",
        )
    project = get_or_create_project(session, project_name)
    endpoint = WebhookEndpoint(
        id=new_id("we_"),
        project_id=project.id,
        url=url,
        secret=new_secret(),
        event_types=sorted(set(events)) if events else None,
        created_at=now(),
    )
    session.add(endpoint)
    session.flush()
    return endpoint


def list_endpoints(
    session: Session, project_name: str | None = None
) -> list[tuple[WebhookEndpoint, str]]:
    query = select(WebhookEndpoint, Project.name).join(
        Project, Project.id == WebhookEndpoint.project_id
    )
    if project_name is not None:
        query = query.where(Project.name == project_name)
    rows = session.execute(query.order_by(WebhookEndpoint.created_at, WebhookEndpoint.id))
    return [(endpoint, name) for endpoint, name in rows.tuples()]


def remove_endpoint(session: Session, endpoint_id: str) -> None:
    endpoint = session.get(WebhookEndpoint, endpoint_id)
    if endpoint is None:
        raise NotFound(f"No such webhook endpoint: {endpoint_id[:64]}")
    # Pending deliveries go with it (foreign key cascade).
    session.delete(endpoint)
    session.flush()
