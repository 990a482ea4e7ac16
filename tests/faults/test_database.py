"""Postgres dropping every connection, mid-batch and mid-upload."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx

from tests.faults.checks import (
    assert_batch_whole,
    assert_no_half_file,
    attempts,
    wait_progress,
)
from tests.faults.conftest import Stack
from tests.faults.test_workers import _lines
from tests.helpers import jsonl, line, submit, wait_until


def test_postgres_connections_dropped_mid_batch(fault: Stack) -> None:
    client = fault.client()
    fault.worker()
    requests = _lines("pgdrop", 200, 64)
    batch = submit(client, jsonl(requests))
    first = wait_progress(client, batch.id).request_counts.completed
    # A burst of drops, so some land inside a claim, a result write or a heartbeat (a lone
    # drop mostly hits idle pooled connections, which pre_ping replaces unnoticed).
    killed = []
    for _ in range(12):
        killed.append(fault.terminate_backends())
        time.sleep(0.25)
    second = client.batches.retrieve(batch.id).request_counts.completed
    done = assert_batch_whole(fault, client, batch.id, [r["custom_id"] for r in requests])
    assert done.batch.status == "completed"
    tries = attempts(fault, batch.id)
    # A line fails only if drops hit it max_attempts (3) times; it then says so.
    for e in done.errs:
        assert e["response"]["body"]["error"]["code"] == "max_attempts_exceeded", e
    print(
        f"pg drop: killed {killed} connections between {first} and {second} lines done; "
        f"attempts {tries}, {len(done.out)} ok, {len(done.errs)} failed"
    )


def upload_body(boundary: str, filename: str, payload: bytes) -> tuple[bytes, bytes]:
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"'
        "\r\nContent-Type: application/jsonl\r\n\r\n"
    ).encode()
    return head, f"\r\n--{boundary}--\r\n".encode()


def big_jsonl(n: int, prefix: str) -> bytes:
    pad = "x" * 900
    return jsonl([line(f"{prefix}-{i}", {"prompt": f"{i} {pad}"}) for i in range(n)])


def visible(client: Any, filename: str) -> list[Any]:
    return [f for f in client.files.list(purpose="batch").data if f.filename == filename]


def test_postgres_connections_dropped_mid_upload(fault: Stack) -> None:
    client = fault.client()
    name = f"pgdrop-{uuid.uuid4().hex[:8]}.jsonl"
    payload = big_jsonl(5000, "up")  # ~5 MB: five 1 MB chunk rows
    boundary = uuid.uuid4().hex
    head, tail = upload_body(boundary, name, payload)
    cut = 3 * 1024 * 1024

    def chunks_written() -> bool:
        # An insert holds its table's ROW EXCLUSIVE lock until the transaction ends: the
        # API's upload has written chunk rows that are not committed yet.
        return bool(
            fault.scalar(
                "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
                "WHERE c.relname = 'file_chunks' AND l.mode = 'RowExclusiveLock' "
                "AND l.granted AND l.pid <> pg_backend_pid() "
                "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            )
        )

    def body() -> Iterator[bytes]:
        yield head
        for i in range(0, cut, 256 * 1024):
            yield payload[i : i + 256 * 1024]
        wait_until(chunks_written, "the API's upload transaction writes chunk rows")
        body.killed = fault.terminate_backends()  # type: ignore[attr-defined]
        for i in range(cut, len(payload), 256 * 1024):
            yield payload[i : i + 256 * 1024]
        yield tail

    headers = {
        "Authorization": f"Bearer {fault.api_key}",
        "Content-Type": f"multipart/form-data; boundary={boundary}",
    }
    try:
        resp = httpx.post(fault.api_url + "/v1/files", content=body(), headers=headers, timeout=60)
        outcome = f"HTTP {resp.status_code}"
        if resp.status_code == 200:
            assert resp.json()["bytes"] == len(payload)  # succeeded: then it is whole
        else:
            assert 400 <= resp.status_code < 600
            err = resp.json()["error"]
            assert err["message"] and err["type"], err
            outcome += f" {err['type']}: {err['message']}"
    except httpx.TransportError as exc:  # the API answered early and closed the stream
        outcome = f"transport error {exc!r}"

    if not outcome.startswith("HTTP 200"):
        assert visible(client, name) == []
        assert fault.scalar("SELECT count(*) FROM files WHERE filename = %s", name) == 0
    retry = assert_no_half_file(fault, client, name, payload)
    print(
        f"pg drop mid-upload: {body.killed} connections killed, first try {outcome}; "  # type: ignore[attr-defined]
        f"retry {retry.bytes} bytes ok"
    )
