"""Control work never waits for a generation slice, in the topologies the README documents.

A generation worker's solo pool runs one task at a time, and a `process` task holds it
for a whole work slice. Control work (validate, finalize, sweep) runs in the control
worker that `batchwright worker` starts beside itself (worker/supervisor.py). Each test
holds a worker in a generation task by holding its result writes (a lock on its batch's
row), so the slice lasts as long as the test wants, whatever the engine's speed (issue 22,
items 1 and 10).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg

from tests.conftest import Proc
from tests.helpers import jsonl, line, read_jsonl, submit, wait_batch
from tests.shared.conftest import Service

# Bounds on waiting for what the design promises within seconds; reached only if it broke.
PATIENCE = 120.0
LEASE_SECONDS = 6.0  # the stack's (tests/shared/conftest.py)
SWEEP_SECONDS = 2.0


def _lines(prefix: str, n: int, model: str = "demo", max_tokens: int = 16) -> bytes:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    return jsonl([line(f"{prefix}-{i}", body) for i in range(n)])


def _leases(svc: Service, batch_id: str) -> set[str]:
    rows = svc.sql(
        "SELECT DISTINCT lease_token FROM batch_requests WHERE batch_id = %s AND state = 'running'",
        batch_id,
    )
    return {token for (token,) in rows}


def _activity(svc: Service) -> list[tuple[object, ...]]:
    """Who waits for whom in the test database: for a failure's message."""
    return svc.sql(
        "SELECT pid, application_name, state, wait_event_type, pg_blocking_pids(pid), "
        "left(query, 160) FROM pg_stat_activity WHERE datname = current_database()"
    )


def _status(svc: Service, batch_id: str) -> str:
    return str(svc.sql("SELECT status FROM batches WHERE id = %s", batch_id)[0][0])


@contextmanager
def _batch_row_held(svc: Service, batch_id: str) -> Iterator[psycopg.Connection]:
    """The batch's row locked from the moment validation commits: every result write of
    the batch waits at its first statement (results.py locks the batch rows first) holding
    no line, so the worker that generates it stays in its generation task."""
    end = time.monotonic() + PATIENCE
    with psycopg.connect(svc.pg_url, connect_timeout=5) as conn:
        while True:
            # While validation holds the row this waits, and gets it as validation commits,
            # ahead of any write (a worker writes only after it generated).
            row = conn.execute(
                "SELECT status FROM batches WHERE id = %s FOR UPDATE", (batch_id,)
            ).fetchone()
            if row and row[0] == "in_progress":
                break
            conn.rollback()  # validation has not started: let it take the row
            assert time.monotonic() < end, f"{batch_id} never in progress: {_activity(svc)}"
            time.sleep(0.005)
        yield conn
        conn.rollback()


def test_control_work_runs_beside_a_held_generation_slice(svc: Service) -> None:
    """One worker, as the README starts it by hand: while another team's batch holds its
    generation task, a small batch is validated, and cancelled it is finalized."""
    svc.workers([])
    team_a, team_b = svc.client(svc.key("team-a")), svc.client(svc.key("team-b"))
    big = submit(team_a, _lines("a", 200))
    with _batch_row_held(svc, big.id):
        # Its lines are in the worker's generation task, which cannot end while their
        # results cannot land.
        held = svc.wait(lambda: _leases(svc, big.id), PATIENCE, "A's lines in the worker")
        # B's lines are of the other model: the worker's one generation task is A's, so
        # none of B runs, and nothing but control work can move B.
        small = submit(team_b, _lines("b", 20, model="demo-b"))
        svc.wait(lambda: _status(svc, small.id) == "in_progress", PATIENCE, "B validated")
        team_b.batches.cancel(small.id)
        svc.wait(lambda: _status(svc, small.id) == "cancelled", PATIENCE, "B finalized")
        # The generation task held A's lines all along.
        assert held <= _leases(svc, big.id)

    cancelled = wait_batch(team_b, small.id)
    assert cancelled.request_counts.total == 20
    errors = read_jsonl(team_b, cancelled.error_file_id)
    assert sorted(e["error"]["code"] for e in errors) == ["batch_cancelled"] * 20
    done = wait_batch(team_a, big.id, timeout=600)
    assert done.status == "completed" and done.request_counts.completed == 200


def _freeze_idle(svc: Service, proc: Proc, app: str, batch_id: str, holder: int) -> set[str]:
    """SIGSTOP the worker's process group while it holds lines of `batch_id` and none of
    its database sessions is inside a transaction (frozen in one, it would keep its
    lines locked, and no sweeper could take them back). A session waiting on `holder`
    (the test's lock on the batch row) holds nothing. Returns the frozen leases."""
    sessions = (
        "SELECT state, pg_blocking_pids(pid) FROM pg_stat_activity WHERE application_name = %s"
    )
    end = time.monotonic() + PATIENCE
    while time.monotonic() < end:
        if _leases(svc, batch_id):
            proc.signal_group(signal.SIGSTOP)
            states = svc.sql(sessions, app)
            leases = _leases(svc, batch_id)
            if leases and all(s == "idle" or b == [holder] for s, b in states):
                return leases
            proc.signal_group(signal.SIGCONT)
        time.sleep(0.05)
    raise TimeoutError(f"the worker never held lines of {batch_id} between transactions")


def test_frozen_workers_lines_come_back_while_the_other_is_busy(svc: Service) -> None:
    """A worker frozen mid-batch (SIGSTOP on its process group: its control worker too);
    the only other worker is held in a generation task. The sweeper's re-drive runs in the
    busy worker's control worker, so the frozen lines are queued again within about a
    lease, not after the busy worker's slice."""
    client = svc.client(svc.key("faults"))
    frozen_app = "bw-frozen-worker"  # libpq's application_name: its sessions, found by name
    frozen = svc.spawn(
        "worker", ["worker", "--models", "demo-b", "--loglevel", "INFO"], PGAPPNAME=frozen_app
    )
    frozen.wait_for("ready.")
    big = submit(client, _lines("busy", 200))
    with _batch_row_held(svc, big.id):
        [busy] = svc.workers(["--models", "demo"])
        busy_leases = svc.wait(lambda: _leases(svc, big.id), PATIENCE, "the busy worker's lines")
        small = submit(client, _lines("frozen", 40, model="demo-b", max_tokens=32))
        with _batch_row_held(svc, small.id) as held:
            holder = held.info.backend_pid
            leases = _freeze_idle(svc, frozen, frozen_app, small.id, holder)
            frozen_at = time.monotonic()

            # Its lease runs out (LEASE_SECONDS) and the next sweep takes its lines back.
            # The bound, in leases and sweeps, is far above that and far below a slice
            # held by the test (on main the sweep waited in the busy worker's pool).
            def back() -> bool:
                return not (_leases(svc, small.id) & leases)

            bound = 4 * LEASE_SECONDS + 10 * SWEEP_SECONDS
            svc.wait(back, bound, f"the frozen worker's lines queued again ({bound:.0f} s)")
            took = time.monotonic() - frozen_at
            # The busy worker was in the same generation task all along.
            assert busy_leases <= _leases(svc, big.id)
            frozen.signal_group(signal.SIGKILL)
    print(f"frozen worker's lines queued again {took:.1f} s after the freeze")

    # Both batches finish whole once a worker serves the frozen one's model again; the
    # frozen run was charged to no line.
    svc.workers(["--models", "demo-b"])
    for batch, n in ((big, 200), (small, 40)):
        final = wait_batch(client, batch.id, timeout=600)
        assert final.status == "completed" and final.request_counts.completed == n, final
    tries = svc.sql(
        "SELECT attempts, count(*) FROM batch_requests WHERE batch_id = %s GROUP BY attempts",
        small.id,
    )
    assert dict(tries) == {1: 40}, tries
    assert busy.popen.poll() is None


def _control_worker(proc: Proc) -> int | None:
    """The pid of the worker's control worker, if it has one now."""
    for task in Path(f"/proc/{proc.popen.pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except FileNotFoundError:
                continue
            if b"--control-only" in cmdline:
                return int(child)
    return None


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie (dead, not yet reaped by its parent) counts as gone.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_control_worker_restarted_and_stopped_with_the_worker(svc: Service) -> None:
    """The control worker a worker starts is started again when it dies, stops with the
    worker's SIGTERM, and dies with a SIGKILLed worker."""
    [worker] = svc.workers([])
    first = svc.wait(lambda: _control_worker(worker), PATIENCE, "a control worker")
    os.kill(first, signal.SIGKILL)
    second = svc.wait(
        lambda: (pid := _control_worker(worker)) != first and pid, PATIENCE, "a new one"
    )
    # The new one does the control work: a batch is validated and finalized.
    client = svc.client(svc.key("restarts"))
    batch = submit(client, _lines("r", 4))
    assert wait_batch(client, batch.id, timeout=PATIENCE * 3).status == "completed"

    assert worker.stop(signal.SIGTERM, timeout=PATIENCE) == 0
    assert _gone(second)

    [killed] = svc.workers([])
    child = svc.wait(lambda: _control_worker(killed), PATIENCE, "its control worker")
    killed.popen.kill()  # the worker alone, not its process group
    killed.popen.wait()
    svc.wait(lambda: _gone(child), PATIENCE, "the control worker's end")
