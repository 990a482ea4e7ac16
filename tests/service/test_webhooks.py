"""Webhooks end to end: CLI endpoints, signed events the openai SDK verifies, retries with
one webhook-id, exactly one successful delivery, private targets refused."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from typing import Any

import psycopg
import pytest
from openai import InvalidWebhookSignatureError, OpenAI

from tests.conftest import create_key
from tests.helpers import jsonl, line, submit, wait_batch
from tests.receiver import receiver


def cli(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "batchwright.cli", "webhooks", *args],
        env=env,
        check=check,
        capture_output=True,
        text=True,
    )


def add_endpoint(env: dict[str, str], project: str, url: str, *events: str) -> tuple[str, str]:
    """(endpoint id, secret) through the real CLI; the secret is stdout's only line."""
    args = ["add", url, "--project", project]
    for event in events:
        args += ["--event", event]
    out = cli(env, *args)
    return out.stderr.split("endpoint id:")[1].split()[0], out.stdout.strip()


def project_client(api_url: str, key: str) -> OpenAI:
    return OpenAI(base_url=api_url + "/v1", api_key=key, max_retries=0, timeout=60)


def delivery_rows(env: dict[str, str], endpoint_id: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(env["BATCHWRIGHT_DATABASE_URL"]) as conn:
        return list(
            conn.execute(
                "SELECT id, state, attempts, event_type FROM webhook_deliveries "
                "WHERE endpoint_id = %s ORDER BY created_at",
                (endpoint_id,),
            )
        )


def wait_rows(env: dict[str, str], endpoint_id: str, state: str, n: int = 1) -> list[Any]:
    end = time.monotonic() + 120
    while True:
        rows = delivery_rows(env, endpoint_id)
        if sum(1 for r in rows if r[1] == state) >= n:
            return rows
        assert time.monotonic() < end, rows
        time.sleep(0.2)


def test_failing_receiver_gets_one_successful_delivery(
    service_env: dict[str, str], api_url: str, worker: Any
) -> None:
    key = create_key(service_env, "hooks-retry")
    client = project_client(api_url, key)
    with receiver(script=[500, 503, 500, 502, 500]) as hook:
        endpoint_id, secret = add_endpoint(service_env, "hooks-retry", hook.url)
        assert secret.startswith("whsec_")
        batch = wait_batch(client, submit(client, b"{not json\n").id)
        assert batch.status == "failed"
        rows = wait_rows(service_env, endpoint_id, "delivered")
        got = hook.requests
    assert [r.answered for r in got] == [500, 503, 500, 502, 500, 200]
    assert len({r.headers["webhook-id"] for r in got}) == 1
    assert [(r[1], r[2], r[3]) for r in rows] == [("delivered", 6, "batch.failed")]
    assert got[0].headers["webhook-id"] == rows[0][0]

    # Every attempt is signed afresh (new timestamp) and verifies with the official SDK.
    sdk = OpenAI(api_key="unused", webhook_secret=secret)
    for request in got:
        event = sdk.webhooks.unwrap(request.body, request.headers)
        assert (event.type, event.data.id, event.object) == ("batch.failed", batch.id, "event")
        assert event.id.startswith("evt_") and event.created_at == batch.failed_at
    with pytest.raises(InvalidWebhookSignatureError):
        sdk.webhooks.unwrap(got[-1].body.replace(b"failed", b"complet"), got[-1].headers)
    with pytest.raises(InvalidWebhookSignatureError):
        OpenAI(api_key="unused").webhooks.unwrap(
            got[-1].body, got[-1].headers, secret="whsec_" + "A" * 44
        )


def test_completed_cancelled_and_expired_events(
    service_env: dict[str, str], api_url: str, worker: Any
) -> None:
    from batchwright.batches.service import create_batch
    from batchwright.config import get_settings
    from batchwright.controlplane.dispatch import InlineDispatcher, get_dispatcher, set_dispatcher
    from batchwright.db.session import session_scope
    from batchwright.protocol.batches import CreateBatch

    key = create_key(service_env, "hooks-events")
    client = project_client(api_url, key)
    with receiver() as hook:
        endpoint_id, secret = add_endpoint(service_env, "hooks-events", hook.url)
        _, only_done = add_endpoint(service_env, "hooks-events", hook.url, "batch.completed")
        done = wait_batch(client, submit(client, jsonl([line("a")])).id)
        assert done.status == "completed"

        cancel = submit(client, jsonl([line(f"c{i}", {"max_tokens": 64}) for i in range(40)]))
        cancelled = wait_batch(client, client.batches.cancel(cancel.id).id)
        assert cancelled.status == "cancelled"

        # Expired: a batch whose validate message is held back past its window; the
        # sweeper finalizes it as expired.
        f = client.files.create(file=("e.jsonl", jsonl([line("e")])), purpose="batch")
        held, previous = InlineDispatcher(), get_dispatcher()
        set_dispatcher(held)
        try:
            with psycopg.connect(service_env["BATCHWRIGHT_DATABASE_URL"]) as conn:
                row = conn.execute("SELECT project_id FROM files WHERE id = %s", (f.id,))
                project_id = row.fetchone()[0]  # type: ignore[index]
            with session_scope() as session:
                req = CreateBatch(
                    input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
                )
                batch = create_batch(session, project_id, req, get_settings())
                batch.expires_at = batch.created_at - 1
                expired_id = batch.id
        finally:
            set_dispatcher(previous)
        assert wait_batch(client, expired_id).status == "expired"

        wait_rows(service_env, endpoint_id, "delivered", 3)
        hook.wait_for(4)
    sdk = OpenAI(api_key="unused")
    seen: dict[str, set[tuple[str, str]]] = {}
    for request in hook.requests:
        for name, sec in (("all", secret), ("completed-only", only_done)):
            try:
                event = sdk.webhooks.unwrap(request.body, request.headers, secret=sec)
            except InvalidWebhookSignatureError:
                continue
            seen.setdefault(name, set()).add((event.type, event.data.id))
    assert seen["all"] == {
        ("batch.completed", done.id),
        ("batch.cancelled", cancel.id),
        ("batch.expired", expired_id),
    }
    assert seen["completed-only"] == {("batch.completed", done.id)}
    assert json.loads(hook.requests[0].body).keys() == {
        "id",
        "object",
        "created_at",
        "type",
        "data",
    }


def test_endpoint_cli_and_private_targets(service_env: dict[str, str]) -> None:
    strict = {**service_env, "BATCHWRIGHT_WEBHOOK_ALLOW_PRIVATE_TARGETS": "false"}
    for url in (
        "http://127.0.0.1:9/hook",
        "http://10.1.2.3/hook",
        "http://[::1]/x",
        "http://[::127.0.0.1]:8499/",  # IPv4-compatible IPv6 of loopback
        "http://[64:ff9b::7f00:1]:8499/",  # NAT64 of loopback
    ):
        out = cli(strict, "add", url, "--project", "hooks-cli", check=False)
        assert out.returncode == 2 and "private, loopback" in out.stderr, out
    bad = cli(strict, "add", "ftp://example.com/x", "--project", "hooks-cli", check=False)
    assert bad.returncode == 2 and "http" in bad.stderr
    allowed = cli(service_env, "add", "http://127.0.0.1:9/hook", "--project", "hooks-cli")
    # The workers check again at every delivery: the note says they need the setting too.
    assert "the workers need BATCHWRIGHT_WEBHOOK_ALLOW_PRIVATE_TARGETS=true too" in allowed.stderr
    endpoint_id = allowed.stderr.split("endpoint id:")[1].split()[0]
    secret = allowed.stdout.strip()
    listed = cli(service_env, "list", "--project", "hooks-cli").stdout
    assert endpoint_id in listed and "127.0.0.1:9" in listed and "none yet" in listed
    assert re.search(r"20\d\d-\d\d-\d\d \d\d:\d\d:\d\d UTC", listed), listed  # not epoch seconds
    assert secret not in listed  # shown once, at creation
    cli(service_env, "remove", endpoint_id)
    assert endpoint_id not in cli(service_env, "list").stdout
    gone = cli(service_env, "remove", endpoint_id, check=False)
    assert gone.returncode == 2


def test_outbox_row_is_written_with_the_status(
    service_env: dict[str, str], api_url: str, worker: Any
) -> None:
    from sqlalchemy import text

    from batchwright.db.models import Batch
    from batchwright.db.session import get_sessionmaker
    from batchwright.webhooks import outbox

    outbox.install()  # as the API, the worker and the embedded run do when they start
    key = create_key(service_env, "hooks-tx")
    client = project_client(api_url, key)
    endpoint_id, _ = add_endpoint(service_env, "hooks-tx", "http://127.0.0.1:9/never")
    batch = wait_batch(client, submit(client, jsonl([line("t")])).id)
    assert len(delivery_rows(service_env, endpoint_id)) == 1  # its batch.completed

    session = get_sessionmaker()()
    try:
        row = session.get(Batch, batch.id)
        assert row is not None
        row.status = "expired"  # any terminal change, in a transaction that will not commit
        session.flush()
        inside = session.scalar(
            text("SELECT count(*) FROM webhook_deliveries WHERE endpoint_id = :e"),
            {"e": endpoint_id},
        )
        assert inside == 2  # written by the same flush as the status
        assert len(delivery_rows(service_env, endpoint_id)) == 1  # invisible until commit
        session.rollback()
    finally:
        session.close()
    assert len(delivery_rows(service_env, endpoint_id)) == 1  # rolled back together


def test_backoff_grows_with_jitter_and_is_capped() -> None:
    from batchwright.config import Settings
    from batchwright.webhooks.delivery import backoff

    settings = Settings(webhook_retry_base_seconds=5, webhook_retry_max_seconds=3600)
    for attempts in range(1, 16):
        step = min(3600.0, 5 * 2.0 ** (attempts - 1))
        waits = {backoff(attempts, settings) for _ in range(50)}
        assert all(step / 2 <= w <= step for w in waits)
        assert len(waits) > 1  # jittered: retries of many receivers do not line up


def test_retries_stop_when_the_window_closes(
    service_env: dict[str, str], api_url: str, worker: Any
) -> None:
    key = create_key(service_env, "hooks-window")
    client = project_client(api_url, key)
    window = 72 * 3600
    with receiver(script=[500] * 50) as hook:
        endpoint_id, _ = add_endpoint(service_env, "hooks-window", hook.url)
        batch = wait_batch(client, submit(client, b"{nope\n").id)
        rows = wait_rows(service_env, endpoint_id, "pending")
        hook.wait_for(1)
        with psycopg.connect(service_env["BATCHWRIGHT_DATABASE_URL"], autocommit=True) as conn:
            # The event is 72 h old: the next failure is its last.
            conn.execute(
                "UPDATE webhook_deliveries SET created_at = created_at - %s WHERE id = %s",
                (window, rows[0][0]),
            )
        rows = wait_rows(service_env, endpoint_id, "failed")
    assert batch.status == "failed"
    attempts = rows[0][2]
    assert len(hook.requests) == attempts  # nothing sent after it gave up
    with psycopg.connect(service_env["BATCHWRIGHT_DATABASE_URL"]) as conn:
        error = conn.execute(
            "SELECT last_error FROM webhook_deliveries WHERE id = %s", (rows[0][0],)
        ).fetchone()
    assert error is not None and "HTTP 500" in error[0]
    # `webhooks list` says so: nothing arrives, and why.
    [row] = [r for r in cli(service_env, "list", "--project", "hooks-window").stdout.splitlines()
             if endpoint_id in r]  # fmt: skip
    assert "1 failed" in row and "HTTP 500" in row, row
