"""The one assertion every fault test ends with: the batch is whole and its numbers add up."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from tests.helpers import TERMINAL, read_jsonl, wait_batch


@dataclass
class Outcome:
    batch: Any
    out: list[dict[str, Any]]
    errs: list[dict[str, Any]]


# Bounds on waiting for conditions, not expectations of speed: on a shared machine under
# heavy load a 300-line batch has taken over 120 s, which failed tests that were right.
PATIENCE = 600.0


def assert_batch_whole(
    stack: Any, client: Any, batch_id: str, custom_ids: list[str], timeout: float = PATIENCE
) -> Outcome:
    """Terminal status; every custom_id exactly once across output and error files;
    request_counts and usage equal the sums over the lines; the rows agree (no line left
    queued/running, one Completion row per succeeded line)."""
    batch = wait_batch(client, batch_id, timeout=timeout)
    assert batch.status in TERMINAL, batch
    out = read_jsonl(client, batch.output_file_id)
    errs = read_jsonl(client, batch.error_file_id)

    seen = Counter(x["custom_id"] for x in out + errs)
    dupes = {k: v for k, v in seen.items() if v > 1}
    assert not dupes, f"custom_ids more than once: {dupes}"
    assert set(seen) == set(custom_ids), (
        f"missing {sorted(set(custom_ids) - set(seen))[:10]}, "
        f"extra {sorted(set(seen) - set(custom_ids))[:10]}"
    )
    # Output follows input order.
    order = {cid: i for i, cid in enumerate(custom_ids)}
    for lines in (out, errs):
        ranks = [order[x["custom_id"]] for x in lines]
        assert ranks == sorted(ranks)

    for o in out:
        assert o["error"] is None and o["response"]["status_code"] == 200, o
    for e in errs:
        assert e["response"] is None or e["response"]["status_code"] != 200, e

    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (
        len(custom_ids),
        len(out),
        len(errs),
    ), counts
    prompt = sum(o["response"]["body"]["usage"]["prompt_tokens"] for o in out)
    completion = sum(o["response"]["body"]["usage"]["completion_tokens"] for o in out)
    assert batch.usage.input_tokens == prompt, (batch.usage, prompt)
    assert batch.usage.output_tokens == completion, (batch.usage, completion)
    assert batch.usage.total_tokens == prompt + completion

    states = dict(
        stack.sql(
            "SELECT state, count(*) FROM batch_requests WHERE batch_id = %s GROUP BY state",
            batch_id,
        )
    )
    assert not {"queued", "running"} & set(states), states
    assert states.get("succeeded", 0) == len(out), states
    completions = stack.scalar("SELECT count(*) FROM completions WHERE batch_id = %s", batch_id)
    assert completions == len(out), (completions, states)
    return Outcome(batch, out, errs)


def wait_progress(client: Any, batch_id: str, at_least: int = 1, timeout: float = PATIENCE) -> Any:
    """Poll until request_counts.completed >= at_least: the middle of the batch."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        b = client.batches.retrieve(batch_id)
        if b.request_counts.completed >= at_least:
            return b
        assert b.status not in TERMINAL, f"batch ended before the fault: {b}"
        time.sleep(0.1)
    raise TimeoutError(f"no progress on {batch_id}")


def attempts(stack: Any, batch_id: str) -> dict[int, int]:
    """How many lines took 1, 2, ... claims."""
    return dict(
        stack.sql(
            "SELECT attempts, count(*) FROM batch_requests WHERE batch_id = %s "
            "GROUP BY attempts ORDER BY attempts",
            batch_id,
        )
    )


def infra_failures(stack: Any, batch_id: str) -> dict[int, int]:
    """How many lines had 0, 1, ... runs lost to the infrastructure."""
    return dict(
        stack.sql(
            "SELECT infra_failures, count(*) FROM batch_requests WHERE batch_id = %s "
            "GROUP BY infra_failures ORDER BY infra_failures",
            batch_id,
        )
    )


def assert_no_half_file(stack: Any, client: Any, name: str, payload: bytes) -> Any:
    """No chunk without its file row; a retried upload of the same bytes then lands whole."""
    orphans = stack.scalar(
        "SELECT count(*) FROM file_chunks c LEFT JOIN files f ON f.id = c.file_id "
        "WHERE f.id IS NULL"
    )
    assert orphans == 0
    retry = client.files.create(file=(name, payload), purpose="batch")
    assert retry.bytes == len(payload)
    assert retry.id in [f.id for f in client.files.list(purpose="batch").data]
    assert client.files.content(retry.id).content == payload
    return retry
