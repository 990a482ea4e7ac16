"""The API process killed mid-upload; a batch outliving its completion window."""

from __future__ import annotations

import signal
import socket
import time
import uuid
from urllib.parse import urlparse

from tests.faults.checks import assert_batch_whole, assert_no_half_file
from tests.faults.conftest import Stack
from tests.faults.test_database import big_jsonl, upload_body, visible
from tests.faults.test_workers import _lines
from tests.helpers import jsonl, submit, wait_batch


def test_api_sigkill_mid_upload(fault: Stack) -> None:
    api, url = fault.api()
    name = f"apikill-{uuid.uuid4().hex[:8]}.jsonl"
    payload = big_jsonl(5000, "k")
    boundary = uuid.uuid4().hex
    head, tail = upload_body(boundary, name, payload)
    host = urlparse(url)
    sock = socket.create_connection((host.hostname, host.port), timeout=10)
    sock.sendall(
        (
            f"POST /v1/files HTTP/1.1\r\nHost: {host.netloc}\r\n"
            f"Authorization: Bearer {fault.api_key}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
            f"Content-Length: {len(head) + len(payload) + len(tail)}\r\n\r\n"
        ).encode()
        + head
        + payload[: 3 * 1024 * 1024]
    )
    # Wait until the API holds an open transaction with chunk rows in it, then kill it.
    end = time.monotonic() + 20
    while (
        fault.scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND state = 'idle in transaction'"
        )
        == 0
    ):
        assert time.monotonic() < end, "the upload never opened a transaction"
        time.sleep(0.05)
    api.stop(signal.SIGKILL)
    sock.close()
    # Postgres notices the dead client and rolls its transaction back.
    end = time.monotonic() + 20
    while fault.scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND state = 'idle in transaction'"
    ):
        assert time.monotonic() < end, "the killed API's transaction is still open"
        time.sleep(0.1)

    client = fault.client()  # the folder's API: a fresh process
    assert visible(client, name) == []
    assert fault.scalar("SELECT count(*) FROM files WHERE filename = %s", name) == 0
    retry = assert_no_half_file(fault, client, name, payload)
    assert [f.id for f in visible(client, name)] == [retry.id]
    print(f"api sigkill mid-upload: 3 MB of {len(payload)} sent, nothing left behind, retry ok")


def test_batch_expires(fault: Stack) -> None:
    """A 4 s completion window (read where the batch is created: the API)."""
    _, url = fault.api(BATCHWRIGHT_COMPLETION_WINDOW_SECONDS="4")
    client = fault.client(url)
    fault.worker()
    # Warm the worker (its model loads on the first task) so the window is spent working.
    warm = submit(fault.client(), jsonl(_lines("warm", 1, 4)))
    assert wait_batch(fault.client(), warm.id, timeout=60).status == "completed"
    requests = _lines("exp", 1500, 64)
    batch = submit(client, jsonl(requests))
    assert batch.expires_at - batch.created_at == 4
    done = assert_batch_whole(fault, client, batch.id, [r["custom_id"] for r in requests])
    assert done.batch.status == "expired", done.batch
    assert done.batch.expired_at is not None
    assert done.out, "no line finished inside the window: not a mid-batch expiry"
    assert done.errs, "every line finished: the window never bit"
    codes = {e["error"]["code"] for e in done.errs if e["error"]}
    assert codes == {"batch_expired"}, codes
    assert all(e["response"] is None for e in done.errs)
    print(
        f"expiry: {len(done.out)} lines kept in the output, {len(done.errs)} batch_expired, "
        f"ended {done.batch.expired_at - done.batch.created_at} s after creation"
    )
