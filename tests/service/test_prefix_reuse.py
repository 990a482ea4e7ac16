"""Shared prefixes through the service: prefix keys at validation, grouped claims, and the
prompt tokens served from the prefix cache in each completion's and the batch's usage."""

from __future__ import annotations

import threading
from typing import Any

from sqlalchemy import select, update

from tests.helpers import jsonl, line, read_jsonl, submit, wait_batch

HEADS = {
    "a": "A: You are a careful assistant. Answer in one short sentence, plainly. " * 4,
    "b": "B: Translate the following words into French and keep their order. " * 4,
}


def _lines() -> list[dict[str, Any]]:
    # Interleaved in the file: a, b, a, b, ...
    return [
        line(
            f"req-{i}",
            {"prompt": HEADS["ab"[i % 2]] + f" item {i}", "max_tokens": 3, "temperature": 0},
        )
        for i in range(12)
    ]


def test_cached_tokens_in_usage_and_output_in_input_order(client: Any) -> None:
    requests = _lines()
    done = wait_batch(client, submit(client, jsonl(requests)).id)
    assert done.status == "completed", done
    out = read_jsonl(client, done.output_file_id)
    assert [o["custom_id"] for o in out] == [r["custom_id"] for r in requests]
    cached = [o["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for o in out]
    prompt = [o["response"]["body"]["usage"]["prompt_tokens"] for o in out]
    assert all(0 <= c < p for c, p in zip(cached, prompt, strict=True))
    # At most the first line of each prefix per engine run computes it in full.
    assert sum(1 for c in cached if c > 0) >= 8
    assert done.usage.input_tokens_details.cached_tokens == sum(cached)


def test_claims_hand_out_lines_grouped_by_prefix(client: Any) -> None:
    from batchwright.config import get_settings
    from batchwright.db.models import Batch, BatchRequest
    from batchwright.db.session import session_scope
    from batchwright.worker.lease_child.claims import Lease

    requests = _lines()
    done = wait_batch(client, submit(client, jsonl(requests)).id)
    assert done.status == "completed", done
    with session_scope() as session:
        keys = dict(
            session.execute(
                select(BatchRequest.line_no, BatchRequest.prefix_key).where(
                    BatchRequest.batch_id == done.id
                )
            ).all()
        )
    assert len({keys[n] for n in range(1, 13, 2)}) == 1  # every "a" line: one key
    assert len({keys[n] for n in range(2, 13, 2)}) == 1
    assert keys[1] != keys[2]
    # Queue the lines again under a model no worker serves, then claim half of them.
    model = "prefix-claim-test"
    with session_scope() as session:
        session.execute(
            update(Batch).where(Batch.id == done.id).values(status="in_progress", model=model)
        )
        session.execute(
            update(BatchRequest).where(BatchRequest.batch_id == done.id).values(state="queued")
        )
    try:
        lease = Lease(model, get_settings(), threading.Event())
        rows = lease.claim(6)
        first = min(keys.values())
        assert [r.line_no for r in rows] == sorted(n for n, k in keys.items() if k == first)
    finally:
        with session_scope() as session:
            session.execute(
                update(Batch).where(Batch.id == done.id).values(status="completed", model="demo")
            )
            session.execute(
                update(BatchRequest)
                .where(BatchRequest.batch_id == done.id)
                .values(state="succeeded", lease_token=None)
            )
