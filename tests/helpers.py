"""Small helpers shared by the service tests."""

from __future__ import annotations

import json
import time
from typing import Any

TERMINAL = {"completed", "failed", "cancelled", "expired"}


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
