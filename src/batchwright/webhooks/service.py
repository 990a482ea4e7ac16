"""Webhook endpoints of a project: add (secret returned once), list, remove."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from batchwright.auth.service import get_or_create_project
from batchwright.config import Settings
from batchwright.db.base import new_id, now
from batchwright.db.models import Project, WebhookDelivery, WebhookEndpoint
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


@dataclass
class DeliveryState:
    """An endpoint's deliveries by state, and the last error of one (why nothing arrives)."""

    counts: dict[str, int] = field(default_factory=dict)
    last_error: str | None = None


def delivery_states(session: Session, endpoint_ids: Sequence[str]) -> dict[str, DeliveryState]:
    states = {endpoint_id: DeliveryState() for endpoint_id in endpoint_ids}
    rows = session.execute(
        select(WebhookDelivery.endpoint_id, WebhookDelivery.state, func.count())
        .where(WebhookDelivery.endpoint_id.in_(endpoint_ids))
        .group_by(WebhookDelivery.endpoint_id, WebhookDelivery.state)
    )
    for endpoint_id, name, count in rows.tuples():
        states[endpoint_id].counts[name] = count
    for endpoint_id, state in states.items():
        state.last_error = session.scalar(
            select(WebhookDelivery.last_error)
            .where(
                WebhookDelivery.endpoint_id == endpoint_id,
                WebhookDelivery.last_error.is_not(None),
            )
            .order_by(WebhookDelivery.next_attempt_at.desc())
            .limit(1)
        )
    return states


def remove_endpoint(session: Session, endpoint_id: str) -> None:
    endpoint = session.get(WebhookEndpoint, endpoint_id)
    if endpoint is None:
        raise NotFound(f"No such webhook endpoint: {endpoint_id[:64]}")
    # Pending deliveries go with it (foreign key cascade).
    session.delete(endpoint)
    session.flush()
