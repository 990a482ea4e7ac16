"""The outbox: a batch reaching a terminal status writes its webhook deliveries in the same
transaction (invariant 9), whichever code path set the status.

A `before_flush` hook on every Session sees the status change and adds one delivery row per
subscribed endpoint to the flush that writes the status, so the event commits or rolls back
with it. Whatever composes a process that changes batches (the API app, the Celery worker's
tasks module, the embedded run) installs the hook (`install`). After the commit a task is
sent to deliver each row; if that message is lost, or a worker dies mid-request, the sweeper
re-sends whatever is due (resend_due).
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from sqlalchemy import event, inspect, or_, select
from sqlalchemy.orm import Session

from batchwright.config import get_settings
from batchwright.controlplane.dispatch import Dispatcher, get_dispatcher
from batchwright.db.base import new_id, now
from batchwright.db.models import Batch, WebhookDelivery, WebhookEndpoint
from batchwright.db.session import after_commit, session_scope

DELIVER = "batchwright.deliver_webhook"
EVENTS = {
    "completed": "batch.completed",
    "failed": "batch.failed",
    "expired": "batch.expired",
    "cancelled": "batch.cancelled",
}
RESEND_LIMIT = 500


def payload(event_id: str, event_type: str, created_at: int, batch_id: str) -> str:
    """OpenAI's webhook event shape (openai.types.webhooks.Batch*WebhookEvent)."""
    return orjson.dumps(
        {
            "id": event_id,
            "object": "event",
            "created_at": created_at,
            "type": event_type,
            "data": {"id": batch_id},
        }
    ).decode()


def record(session: Session, batch: Batch) -> list[str]:
    """Delivery rows for the batch's terminal status; returns their ids."""
    event_type = EVENTS[batch.status]
    with session.no_autoflush:
        endpoints = list(
            session.scalars(
                select(WebhookEndpoint).where(WebhookEndpoint.project_id == batch.project_id)
            )
        )
    wanted = [e for e in endpoints if e.event_types is None or event_type in e.event_types]
    if not wanted:
        return []
    created = getattr(batch, f"{batch.status}_at", None) or now()
    body = payload(new_id("evt_"), event_type, created, batch.id)
    ids: list[str] = []
    stamp = time.time()
    for endpoint in wanted:
        delivery = WebhookDelivery(
            id=new_id("msg_"),
            endpoint_id=endpoint.id,
            event_type=event_type,
            payload=body,
            state="pending",
            attempts=0,
            created_at=stamp,
            next_attempt_at=stamp,
        )
        session.add(delivery)
        ids.append(delivery.id)
    if not get_settings().embedded:  # the embedded default has no task queue to deliver on
        after_commit(session, lambda: _send_all(ids))
    return ids


def _send_all(ids: list[str]) -> None:
    for delivery_id in ids:
        get_dispatcher().send(DELIVER, delivery_id)


def _became_terminal(batch: Batch) -> bool:
    if batch.status not in EVENTS:
        return False
    history = inspect(batch).attrs.status.history
    return bool(history.added) and batch.status not in (history.deleted or ())


def _on_flush(session: Session, _context: Any, _instances: Any) -> None:
    for obj in list(session.dirty):
        if isinstance(obj, Batch) and _became_terminal(obj):
            record(session, obj)


def install() -> None:
    """Write the outbox with every terminal status this process flushes (idempotent)."""
    if not event.contains(Session, "before_flush", _on_flush):
        event.listen(Session, "before_flush", _on_flush)


def resend_due(dispatcher: Dispatcher) -> int:
    """Called by the sweeper: re-send deliveries that are due and held by no live sender."""
    stamp = time.time()
    with session_scope() as session:
        due = list(
            session.scalars(
                select(WebhookDelivery.id)
                .where(
                    WebhookDelivery.state == "pending",
                    WebhookDelivery.next_attempt_at <= stamp,
                    or_(
                        WebhookDelivery.claimed_until.is_(None),
                        WebhookDelivery.claimed_until < stamp,
                    ),
                )
                .order_by(WebhookDelivery.next_attempt_at)
                .limit(RESEND_LIMIT)
            )
        )
    if get_settings().embedded:
        return 0
    for delivery_id in due:
        dispatcher.send(DELIVER, delivery_id)
    return len(due)
