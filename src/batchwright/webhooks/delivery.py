"""Send one outbox row: claim it, POST the signed event, record the outcome.

At least once: the row is marked delivered only after a 2xx, so a sender that dies
between the receiver's answer and the commit leads to one more send with the same
webhook-id (receivers deduplicate on it). A claim (`claimed_until`) keeps two senders off
one row; it runs out on its own if the sender is killed, and the sweeper re-sends.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from batchwright.config import Settings, get_settings
from batchwright.db.models import WebhookDelivery, WebhookEndpoint
from batchwright.db.session import session_scope
from batchwright.errors import InvalidRequest
from batchwright.webhooks import sender, signing
from batchwright.webhooks.targets import RefusedTarget, split_url

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Claimed:
    id: str
    url: str
    secret: str
    payload: str


def backoff(attempts: int, settings: Settings) -> float:
    """Exponential with equal jitter: half the step fixed, half random, capped."""
    step = min(
        settings.webhook_retry_max_seconds,
        settings.webhook_retry_base_seconds * 2.0 ** max(attempts - 1, 0),
    )
    return step / 2 + random.uniform(0, step / 2)


def claim(session: Session, delivery_id: str, settings: Settings) -> Claimed | None:
    stamp = time.time()
    row = session.execute(
        select(WebhookDelivery, WebhookEndpoint)
        .join(WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id)
        .where(
            WebhookDelivery.id == delivery_id,
            WebhookDelivery.state == "pending",
            WebhookDelivery.next_attempt_at <= stamp,
            or_(WebhookDelivery.claimed_until.is_(None), WebhookDelivery.claimed_until < stamp),
        )
        .with_for_update(skip_locked=True, of=WebhookDelivery)
    ).one_or_none()
    if row is None:
        return None  # delivered, not yet due, or another sender has it
    delivery, endpoint = row
    # Connect, write and read each get the timeout; the claim outlives all three.
    delivery.claimed_until = stamp + 3 * settings.webhook_timeout_seconds + 5
    return Claimed(delivery.id, endpoint.url, endpoint.secret, delivery.payload)


def _send(claimed: Claimed, settings: Settings) -> tuple[bool, str | None, bool]:
    """(delivered, error, retryable)"""
    headers = signing.headers(claimed.secret, claimed.id, int(time.time()), claimed.payload)
    try:
        split_url(claimed.url)
    except InvalidRequest as exc:
        return False, exc.message, False
    try:
        answer = sender.post(
            claimed.url,
            claimed.payload.encode(),
            headers,
            timeout=settings.webhook_timeout_seconds,
            allow_private=settings.webhook_allow_private_targets,
        )
    except RefusedTarget as exc:
        return False, exc.message, False
    except InvalidRequest as exc:  # a name that does not resolve now may resolve later
        return False, exc.message, True
    except sender.FAILURES as exc:
        return False, f"{type(exc).__name__}: {exc}"[:500], True
    if 200 <= answer.status < 300:
        return True, None, False
    text = answer.body[:200].decode("utf-8", "replace")
    return False, f"HTTP {answer.status}: {text}", True


def deliver(delivery_id: str, settings: Settings | None = None) -> float | None:
    """One attempt. Returns seconds until the next attempt when one is scheduled."""
    settings = settings or get_settings()
    with session_scope() as session:
        claimed = claim(session, delivery_id, settings)
    if claimed is None:
        return None
    ok, error, retryable = _send(claimed, settings)
    stamp = time.time()
    with session_scope() as session:
        row = session.get(WebhookDelivery, delivery_id, with_for_update=True)
        if row is None or row.state != "pending":
            return None
        row.attempts += 1
        row.claimed_until = None
        if ok:
            row.state, row.delivered_at, row.last_error = "delivered", stamp, None
            return None
        row.last_error = error
        delay = backoff(row.attempts, settings)
        if not retryable or stamp + delay > row.created_at + settings.webhook_retry_window_seconds:
            row.state = "failed"
            log.warning("webhook %s failed for good (%d attempts): %s", row.id, row.attempts, error)
            return None
        row.next_attempt_at = stamp + delay
        return delay
