"""Small helpers shared by the service tests."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

TERMINAL = {"completed", "failed", "cancelled", "expired"}

_FINISHED = (
    "SELECT count(*) FROM batch_requests WHERE batch_id = %s AND state IN ('succeeded', 'failed')"
)


@contextmanager
def results_held(pg_url: str) -> Iterator[psycopg.Connection]:
    """No result can land while this is open (a SHARE lock on completions blocks the
    writers' COPY), so no line leaves `running` and no worker can finish a batch alone.
    Reads go on; a blocked write keeps its batch row locked, so nothing that updates the
    batch (a cancel, say) can complete inside."""
    with psycopg.connect(pg_url, connect_timeout=5) as conn:
        conn.execute("LOCK TABLE completions IN SHARE MODE")
        yield conn
        conn.rollback()


@contextmanager
def held_mid_batch(
    pg_url: str, batch_id: str, at_least: int = 1, timeout: float = 600
) -> Iterator[int]:
    """Results held (see results_held) from a moment the batch has at least `at_least`
    finished lines; yields how many. However fast the engine, the batch is mid-way until the
    block ends: looking first and acting after could find it done (at CPU speeds a
    100-line batch takes a fraction of a second)."""
    end = time.monotonic() + timeout
    while True:
        with results_held(pg_url) as conn:
            row = conn.execute(_FINISHED, (batch_id,)).fetchone()
            done = int(row[0]) if row else 0
            if done >= at_least:
                yield done
                return
        assert time.monotonic() < end, f"{batch_id}: {done} of {at_least} lines finished"
        time.sleep(0.05)


def wait_until(
    condition: Callable[[], Any], what: str, timeout: float = 120, every: float = 0.05
) -> Any:
    """Poll until `condition()` returns something true, and return it; fail naming `what`
    after `timeout` seconds (a bound on a state that must come, not a guess at speed)."""
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"{what} not reached in {timeout} s")
        time.sleep(every)


def line(custom_id: str, body: dict[str, Any] | None = None, **over: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "demo", "prompt": f"Say {custom_id}", "max_tokens": 4, **(body or {})},
        **over,
    }


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def wait_batch(
    client: Any, batch_id: str, timeout: float = 240, seen: list[Any] | None = None
) -> Any:
    end = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if seen is not None:
            seen.append(batch)
        if batch.status in TERMINAL:
            return batch
        if time.monotonic() > end:
            raise TimeoutError(f"batch {batch_id} still {batch.status}: {batch}")
        time.sleep(0.3)


def submit(client: Any, data: bytes, name: str = "input.jsonl", **kw: Any) -> Any:
    f = client.files.create(file=(name, data), purpose="batch")
    return client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h", **kw
    )


def read_jsonl(client: Any, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    text = client.files.content(file_id).text
    return [json.loads(x) for x in text.splitlines() if x]
