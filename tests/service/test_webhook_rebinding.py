"""Delivery-time checks of webhook targets: the address checked is the address connected to.

The name `hooks.rebind.test` is answered by a small fake DNS (socket.getaddrinfo, in this
process): the names a test uses are not in any real DNS, and traffic stays on loopback —
a public address the fake hands out cannot be resolved to a connection.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.receiver import Receiver, receiver

NAME = "hooks.rebind.test"
PUBLIC = "93.184.215.14"

Answers = Callable[[int], str]


@pytest.fixture
def fake_dns(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Answers], list[str]]]:
    """Install answers for NAME (the n-th lookup gets answers(n)); returns the lookups seen."""
    real = socket.getaddrinfo
    lookups: list[str] = []

    def install(answers: Answers) -> list[str]:
        def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
            if host == NAME:
                lookups.append(host)
                return real(answers(len(lookups)), port, *args, **kwargs)
            if host == PUBLIC:  # never leave the machine
                raise socket.gaierror(socket.EAI_NONAME, "test: no route off loopback")
            return real(host, port, *args, **kwargs)

        monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
        return lookups

    yield install


def _delivery(hook: Receiver, allow_private_at_registration: bool = False) -> str:
    """An endpoint on NAME at the receiver's port, registered while NAME looked public, and
    one pending delivery to it."""
    import time

    from batchwright.config import get_settings
    from batchwright.db.base import new_id
    from batchwright.db.models import WebhookDelivery
    from batchwright.db.session import session_scope
    from batchwright.webhooks.outbox import payload
    from batchwright.webhooks.service import add_endpoint

    port = int(hook.url.rsplit(":", 1)[1].split("/")[0])
    settings = get_settings().model_copy(
        update={"webhook_allow_private_targets": allow_private_at_registration}
    )
    with session_scope() as session:
        endpoint = add_endpoint(session, "rebind", f"http://{NAME}:{port}/hook", settings)
        delivery = WebhookDelivery(
            id=new_id("msg_"),
            endpoint_id=endpoint.id,
            event_type="batch.completed",
            payload=payload(new_id("evt_"), "batch.completed", 1, "batch_x"),
            state="pending",
            attempts=0,
            created_at=time.time(),
            next_attempt_at=time.time(),
        )
        session.add(delivery)
        return delivery.id


def _deliver(delivery_id: str, *, allow_private: bool) -> tuple[str, str | None]:
    from batchwright.config import get_settings
    from batchwright.db.models import WebhookDelivery
    from batchwright.db.session import session_scope
    from batchwright.webhooks.delivery import deliver

    settings = get_settings().model_copy(update={"webhook_allow_private_targets": allow_private})
    deliver(delivery_id, settings)
    with session_scope() as session:
        row = session.get(WebhookDelivery, delivery_id)
        assert row is not None
        return row.state, row.last_error


def test_rebinding_name_cannot_reach_loopback(
    service_env: dict[str, str], fake_dns: Callable[[Answers], list[str]]
) -> None:
    """NAME answers a public address to the registration's lookup and the delivery's
    first, 127.0.0.1 after (DNS rebinding): the check and the connection must use the same
    answer."""
    with receiver() as hook:
        lookups = fake_dns(lambda n: PUBLIC if n <= 2 else "127.0.0.1")
        delivery_id = _delivery(hook)
        state, error = _deliver(delivery_id, allow_private=False)
        assert hook.requests == []  # nothing reached the loopback receiver
    assert len(lookups) == 2  # registration; the delivery's check and connection share one
    assert state == "pending" and error, error  # could not connect: retried later


def test_name_now_private_is_refused_at_delivery(
    service_env: dict[str, str], fake_dns: Callable[[Answers], list[str]]
) -> None:
    with receiver() as hook:
        lookups = fake_dns(lambda n: PUBLIC if n == 1 else "::ffff:127.0.0.1")
        delivery_id = _delivery(hook)
        state, error = _deliver(delivery_id, allow_private=False)
        assert hook.requests == []
    assert len(lookups) == 2  # registration, then the delivery
    assert state == "failed", (state, error)  # refused for good, not retried
    assert error and "127.0.0.1" in error and "private, loopback" in error, error


def test_checked_address_keeps_the_host_header(
    service_env: dict[str, str], fake_dns: Callable[[Answers], list[str]]
) -> None:
    with receiver() as hook:
        lookups = fake_dns(lambda n: "127.0.0.1")
        delivery_id = _delivery(hook, allow_private_at_registration=True)
        state, error = _deliver(delivery_id, allow_private=True)
        [got] = hook.wait_for(1)
    assert (state, error) == ("delivered", None)
    assert got.headers["host"] == f"{NAME}:{hook.url.rsplit(':', 1)[1].split('/')[0]}"
    assert got.headers["webhook-id"] == delivery_id
    assert len(lookups) == 1  # allowed: registration does not resolve; the delivery once
