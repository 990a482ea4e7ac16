"""Eight workers SIGKILLed over one 2,000-line batch: every line completes, and no line
is charged an attempt for a death that was not its doing (issue 9, item 7)."""

from __future__ import annotations

import os
import time
from collections import Counter

from tests.faults.checks import assert_batch_whole, attempts, infra_failures
from tests.faults.conftest import Stack
from tests.faults.kills import kill_holding
from tests.helpers import held_mid_batch, jsonl, line, submit

LINES = int(os.environ.get("BW_KILL_LINES", "2000"))
KILLS = int(os.environ.get("BW_KILL_COUNT", "8"))
# Wider claims and batches than the suite's default: the figure is about deaths, and the
# 2,000 short lines should not take most of the suite's time.
WORKER = {"BATCHWRIGHT_CLAIM_BATCH_SIZE": "32"}


def test_eight_kills_over_a_big_batch(fault: Stack) -> None:
    client = fault.client()
    requests = [
        line(f"k-{i}", {"max_tokens": 6, "seed": i, "temperature": 0.7}) for i in range(LINES)
    ]
    started = time.monotonic()
    proc = fault.worker(**WORKER)
    batch = submit(client, jsonl(requests))
    lost_rows: list[int] = []
    dead: set[str] = set()
    for k in range(1, KILLS + 1):
        # Spread over the batch: each kill waits for its share of the lines to be done.
        with held_mid_batch(fault.pg_url, batch.id, LINES * k // (KILLS + 2)):
            lost_rows.append(kill_holding(fault, proc, batch.id, dead))
        proc = fault.worker(**WORKER)
    done = assert_batch_whole(
        fault, client, batch.id, [r["custom_id"] for r in requests], timeout=900
    )
    took = time.monotonic() - started
    assert done.batch.status == "completed"
    assert (done.batch.request_counts.completed, done.batch.request_counts.failed) == (LINES, 0)
    tries, lost = attempts(fault, batch.id), infra_failures(fault, batch.id)
    assert tries == {1: LINES}, tries  # no line used an attempt on a worker's death
    assert sum(n for k, n in lost.items() if k >= 1) >= max(lost_rows, default=0), lost
    states = Counter(
        dict(
            fault.sql(
                "SELECT state, count(*) FROM batch_requests WHERE batch_id = %s GROUP BY state",
                batch.id,
            )
        )
    )
    print(
        f"kills: {KILLS} SIGKILLs, {LINES} lines, {states['succeeded']} completed, "
        f"{done.batch.request_counts.failed} failed, rows held at each kill {lost_rows}, "
        f"attempts {tries}, runs lost per line {lost}, {took:.1f} s from first worker start"
    )
