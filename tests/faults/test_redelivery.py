"""A task delivered twice, or run twice at once, does no harm (in-process, test database).

The runner functions are what the Celery tasks call; here two threads call each of them
at the same time, as two workers would after a redelivery (visibility timeout, a lost ack,
a sweeper re-send racing the original message)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest

from tests.faults.checks import PATIENCE, assert_batch_whole, attempts, infra_failures
from tests.faults.conftest import Stack
from tests.faults.fakes import FakeEngine, lease_lines, provider
from tests.faults.test_workers import _lines
from tests.helpers import jsonl, submit


def _twice(fn: Callable[[], Any]) -> list[Any]:
    """Run fn in two threads released together; re-raise the first error."""
    start = threading.Barrier(2)
    results: list[Any] = [None, None]
    errors: list[BaseException] = []

    def go(i: int) -> None:
        start.wait()
        try:
            results[i] = fn()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(PATIENCE)
        assert not t.is_alive(), f"{fn} still running after {PATIENCE} s"
    if errors:
        raise errors[0]
    return results


def test_tasks_run_twice_at_once(fault: Stack, in_process: Any) -> None:
    from batchwright import control
    from batchwright.worker.generation import runner

    client = fault.client()
    requests = _lines("twice", 60, 8)
    batch = submit(client, jsonl(requests))

    _twice(lambda: control.validate_batch(batch.id))
    rows = fault.scalar("SELECT count(*) FROM batch_requests WHERE batch_id = %s", batch.id)
    assert rows == len(requests)
    assert client.batches.retrieve(batch.id).status == "in_progress"

    both = threading.Barrier(2, timeout=PATIENCE)

    class Overlapping(FakeEngine):
        """Holds its run's first line until the other run holds one too: the two runs
        overlap however long either takes to start (a lease process each), and neither
        can take the whole batch first (a lease claims only as its engine takes lines)."""

        def run(self, requests: Iterable[Any], cancelled: Any = None) -> Iterator[Any]:
            from batchwright.engine.requests.types import WAKE

            lines = (r for r in requests if r is not WAKE)
            first = next(lines)
            both.wait()
            yield from super().run([first])
            yield from super().run(lines)

    landed = _twice(lambda: runner.process("demo", engine_provider=provider(Overlapping())))
    assert sum(landed) == len(requests), landed
    assert min(landed) > 0, f"one thread did all the work: {landed}"
    assert attempts(fault, batch.id) == {1: len(requests)}
    # And once more after the fact, as a late redelivery: nothing left to claim.
    assert runner.process("demo", engine_provider=provider(FakeEngine())) == 0

    _twice(lambda: control.finalize_batch(batch.id))
    _twice(lambda: control.finalize_batch(batch.id))
    files = fault.scalar("SELECT count(*) FROM files WHERE filename LIKE %s", f"{batch.id}_%")
    assert files == 1, f"{files} output/error files for one batch"
    done = assert_batch_whole(fault, client, batch.id, [r["custom_id"] for r in requests])
    assert done.batch.status == "completed"
    assert done.batch.usage.input_tokens == 3 * len(requests)
    print(f"twice: process threads landed {landed}, one output file, completions {len(done.out)}")


def test_late_write_after_lease_lost_is_dropped(fault: Stack, in_process: Any) -> None:
    """A worker that stalls past its lease: the sweeper re-queues its rows, another run
    completes them, and the stalled run's results are dropped, not written twice."""
    from batchwright import control
    from batchwright.worker.generation import runner

    client = fault.client()
    requests = _lines("late", 20, 8)
    batch = submit(client, jsonl(requests))
    control.validate_batch(batch.id)

    stalled = threading.Event()
    release = threading.Event()

    class Stalling(FakeEngine):
        def run(self, reqs: Iterable[Any], cancelled: Any = None) -> Iterator[Any]:
            lines = iter(reqs)
            held = lease_lines(lines)  # claim everything, then stall
            stalled.set()
            release.wait(30)
            yield from super().run(held)
            yield from super().run(lines)

    out: list[int] = []
    t = threading.Thread(
        target=lambda: out.append(runner.process("demo", engine_provider=provider(Stalling())))
    )
    t.start()
    assert stalled.wait(30)
    # The lease runs out (the stalled thread's heartbeat keeps renewing it, so expire it
    # by hand, as a frozen process would let it) and the sweeper re-queues the rows.
    fault.sql("UPDATE batch_requests SET lease_expires_at = 0 WHERE batch_id = %s", batch.id)
    assert control.sweep()["requeued"] == len(requests)
    assert runner.process("demo", engine_provider=provider(FakeEngine())) == len(requests)
    release.set()
    t.join(30)
    assert out == [0], f"the stalled run wrote {out} results after losing its lease"
    control.finalize_batch(batch.id)
    done = assert_batch_whole(fault, client, batch.id, [r["custom_id"] for r in requests])
    assert done.batch.status == "completed"
    # The lost lease was the infrastructure's doing: counted apart, no attempt used.
    assert attempts(fault, batch.id) == {1: len(requests)}
    assert infra_failures(fault, batch.id) == {1: len(requests)}


def test_a_line_locked_by_a_frozen_worker_does_not_hold_the_sweep(
    fault: Stack, in_process: Any
) -> None:
    """A worker frozen inside a transaction holds its lines' row locks for as long as it
    is frozen: the sweeper re-queues every other expired line and comes back for the
    locked one, instead of waiting behind it (and holding every other re-drive)."""
    import psycopg

    from batchwright import control

    client = fault.client()
    requests = _lines("frozen-tx", 12, 8)
    batch = submit(client, jsonl(requests))
    control.validate_batch(batch.id)
    fault.sql(
        "UPDATE batch_requests SET state = 'running', lease_expires_at = 0, "
        "lease_token = 'frozen' WHERE batch_id = %s",
        batch.id,
    )
    with psycopg.connect(fault.pg_url) as frozen:  # a transaction left open, as frozen
        frozen.execute(
            "SELECT id FROM batch_requests WHERE batch_id = %s ORDER BY id LIMIT 1 FOR UPDATE",
            (batch.id,),
        )
        swept: list[dict[str, int]] = []
        t = threading.Thread(target=lambda: swept.append(control.sweep()))
        t.start()
        t.join(60)  # a sweep of 12 lines takes milliseconds; waiting on the lock, forever
        assert not t.is_alive(), "the sweep waited on a frozen worker's row lock"
        assert swept[0]["requeued"] == len(requests) - 1
        frozen.rollback()  # thawed (or killed: the server ends its transaction)
    assert control.sweep()["requeued"] == 1
    queued = fault.scalar(
        "SELECT count(*) FROM batch_requests WHERE batch_id = %s AND state = 'queued'", batch.id
    )
    assert queued == len(requests)


def test_work_slice_gives_the_queue_back(
    fault: Stack, in_process: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once its slice is over a process run stops claiming, finishes or gives back what
    it holds and asks for a follow-up run."""
    from batchwright import control
    from batchwright.config import get_settings
    from batchwright.controlplane import dispatch
    from batchwright.worker.generation import runner

    monkeypatch.setenv("BATCHWRIGHT_WORK_SLICE_SECONDS", "1")
    get_settings.cache_clear()
    client = fault.client()
    requests = _lines("slice", 100, 8)
    batch = submit(client, jsonl(requests))
    control.validate_batch(batch.id)
    in_process.queue.clear()

    # The engine sleeps 0.05 s a line: the batch takes it 5 s at the least, five slices, on
    # a host however fast; so the run ends for its slice, not for want of lines.
    landed = runner.process("demo", engine_provider=provider(FakeEngine(delay=0.05)))
    assert landed < len(requests), landed
    assert (dispatch.PROCESS, ("demo",)) in in_process.queue
    # It gave back what it had claimed and not run: no line is left held.
    held = fault.scalar(
        "SELECT count(*) FROM batch_requests WHERE batch_id = %s AND state = 'running'", batch.id
    )
    assert held == 0
    while runner.process("demo", engine_provider=provider(FakeEngine(delay=0.0))):
        pass
    control.finalize_batch(batch.id)
    assert_batch_whole(fault, client, batch.id, [r["custom_id"] for r in requests])
