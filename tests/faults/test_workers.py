"""Workers dying and racing: leases and idempotent writes keep every line exactly once."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import psycopg

from tests.faults.checks import assert_batch_whole, attempts, infra_failures
from tests.faults.conftest import Stack
from tests.faults.kills import kill_holding
from tests.helpers import held_mid_batch, jsonl, line, results_held, submit


def _lines(prefix: str, n: int, max_tokens: int) -> list[dict[str, Any]]:
    return [
        line(f"{prefix}-{i}", {"max_tokens": max_tokens, "seed": i, "temperature": 0.8})
        for i in range(n)
    ]


def test_worker_sigkill_mid_batch(fault: Stack) -> None:
    client = fault.client()
    first = fault.worker()
    requests = _lines("kill", 100, 48)
    batch = submit(client, jsonl(requests))
    # Killed while it holds leases, mid-batch (conditions, not moments: see kills.py).
    with held_mid_batch(fault.pg_url, batch.id) as before:
        held = kill_holding(fault, first, batch.id)
    fault.worker()  # the sweeper re-queues the dead worker's rows once their lease expires

    done = assert_batch_whole(fault, client, batch.id, [r["custom_id"] for r in requests])
    assert done.batch.status == "completed"
    assert len(done.out) == len(requests)
    tries, lost = attempts(fault, batch.id), infra_failures(fault, batch.id)
    # The dead lease's rows ran again, and the death was not charged to them.
    assert tries == {1: len(requests)}, tries
    assert sum(n for k, n in lost.items() if k >= 1) >= held, lost
    print(f"sigkill: completed {before} before the kill, {held} leased rows lost, lost {lost}")


def _lease_process(proc: Any) -> int:
    """The pid of the worker's lease process (worker/lease_process.py)."""
    tasks = Path(f"/proc/{proc.popen.pid}/task")
    for task in tasks.iterdir():
        for child in (task / "children").read_text().split():
            if b"batchwright.worker.lease_child" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise AssertionError("the worker has no lease process")


def test_lease_process_killed_mid_batch(fault: Stack) -> None:
    """The lease process dies alone (the OOM killer, say): the worker's run fails as the
    infrastructure's, a new lease process takes over, and the dead one's lines come back."""
    client = fault.client()
    worker = fault.worker()
    requests = _lines("child", 100, 48)
    batch = submit(client, jsonl(requests))
    with held_mid_batch(fault.pg_url, batch.id):
        end = time.monotonic() + 120
        while not _running_leases(fault, batch.id):
            assert time.monotonic() < end, "the worker never held rows"
            time.sleep(0.02)
        first = _lease_process(worker)
        os.kill(first, signal.SIGKILL)

    done = assert_batch_whole(fault, client, batch.id, [r["custom_id"] for r in requests])
    assert done.batch.status == "completed"
    assert len(done.out) == len(requests)
    assert worker.popen.poll() is None  # the worker lived on
    assert _lease_process(worker) != first
    # The lost run was charged to no line: its lines were tried once, and counted as lost.
    assert attempts(fault, batch.id) == {1: len(requests)}
    assert sum(n for k, n in infra_failures(fault, batch.id).items() if k >= 1) >= 1


def _running_leases(fault: Stack, batch_id: str) -> set[str]:
    query = (
        "SELECT DISTINCT lease_token FROM batch_requests WHERE batch_id = %s AND state = 'running'"
    )
    return {t for (t,) in fault.sql(query, batch_id)}


def test_two_workers_race(fault: Stack) -> None:
    client = fault.client()
    # A short result queue bounds what one worker takes while its writes wait: the first
    # holds at most its engine's window and queues (about 60 lines), so the second claims
    # from the same 120 however fast the first generates. A blocked write also holds its
    # lines' locks, which holds up lease renewal: the lease outlasts the wait below.
    fault.workers(2, BATCHWRIGHT_RESULT_QUEUE_SIZE="4", BATCHWRIGHT_LEASE_SECONDS="120")
    requests = _lines("race", 120, 32)
    with results_held(fault.pg_url):
        batch = submit(client, jsonl(requests))
        end = time.monotonic() + 90
        live = _running_leases(fault, batch.id)
        while len(live) < 2:
            assert time.monotonic() < end, f"the workers never held leases at once ({live})"
            time.sleep(0.05)
            live = _running_leases(fault, batch.id)
    done = assert_batch_whole(fault, client, batch.id, [r["custom_id"] for r in requests])
    assert done.batch.status == "completed"
    assert len(done.out) == len(requests)
    assert attempts(fault, batch.id) == {1: len(requests)}  # no line claimed twice
    print(f"race: {len(done.out)} lines, {len(live)} leases held at once")


def test_worker_sigterm_stops_claiming_and_exits(fault: Stack) -> None:
    """SIGTERM: the worker finishes or gives back what it holds and exits; what it did not
    take stays queued for the next worker, and nothing runs twice."""
    client = fault.client()
    first = fault.worker()
    requests = _lines("term", 100, 48)
    batch = submit(client, jsonl(requests))
    end = time.monotonic() + 120
    while client.batches.retrieve(batch.id).status != "in_progress":
        assert time.monotonic() < end, "the batch never started"
        time.sleep(0.05)
    # Lines the worker cannot claim however fast it runs (claims skip locked rows): some
    # are still queued when the signal lands, whatever the engine's speed.
    with psycopg.connect(fault.pg_url, connect_timeout=5) as untouched:
        kept = untouched.execute(
            "SELECT id FROM batch_requests WHERE batch_id = %s AND state = 'queued' "
            "AND line_no >= 60 FOR UPDATE SKIP LOCKED",
            (batch.id,),
        ).fetchall()
        assert kept, "the worker had claimed every line before the lock"
        while not _running_leases(fault, batch.id):  # mid-run: it holds lines
            assert time.monotonic() < end, "the worker never held rows"
            time.sleep(0.02)
        started = time.monotonic()
        first.popen.send_signal(signal.SIGTERM)
        code = first.popen.wait(60)
        took = time.monotonic() - started
        untouched.rollback()
    assert code == 0, first.output()[-2000:]
    # Nothing is left leased to the stopped worker: every row is finished or queued again.
    held = fault.scalar(
        "SELECT count(*) FROM batch_requests WHERE batch_id = %s AND state = 'running'", batch.id
    )
    assert held == 0
    remaining = client.batches.retrieve(batch.id)
    assert remaining.request_counts.completed <= len(requests) - len(kept)
    fault.worker()
    done = assert_batch_whole(fault, client, batch.id, [r["custom_id"] for r in requests])
    assert done.batch.status == "completed"
    assert attempts(fault, batch.id) == {1: len(requests)}  # nothing ran twice
    print(f"sigterm: exited in {took:.1f}s with {remaining.request_counts.completed} done")
