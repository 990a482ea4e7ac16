"""Retries: a poison line fails alone without using up its neighbours' attempts, and an
out-of-memory run gives its lines back unharmed and retries with fewer rows."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from tests.faults.checks import assert_batch_whole, attempts
from tests.faults.conftest import Stack
from tests.faults.fakes import FakeEngine, lease_lines, provider
from tests.faults.test_workers import _lines
from tests.helpers import jsonl, submit


def _drive(in_process: Any, engine: Any, batch_id: str, rounds: int = 60) -> None:
    """What follow-up messages and the sweeper do, in-process, until the batch is done."""
    from batchwright import control
    from batchwright.controlplane import dispatch
    from batchwright.db.models import Batch
    from batchwright.db.session import session_scope
    from batchwright.worker.generation import runner

    for _ in range(rounds):
        in_process.queue.clear()
        with contextlib.suppress(RuntimeError):  # a poison line's crash; lines go back
            runner.process("demo", engine_provider=provider(engine))
        control.sweep()
        for name, args in list(in_process.queue):
            if name == dispatch.FINALIZE:
                control.finalize_batch(*args)
        with session_scope() as session:
            batch = session.get(Batch, batch_id)
            if batch is not None and batch.status == "completed":
                return
    raise AssertionError(f"batch {batch_id} not done after {rounds} rounds")


def test_poison_line_fails_alone(fault: Stack, in_process: Any) -> None:
    from batchwright import control

    client = fault.client()
    requests = _lines("poison", 30, 8)
    batch = submit(client, jsonl(requests))
    control.validate_batch(batch.id)

    class Crashing(FakeEngine):
        """Dies whenever the poison line is among the lines it was handed."""

        def run(self, requests: Iterable[Any], cancelled: Any = None) -> Iterator[Any]:
            lines = iter(requests)
            while held := lease_lines(lines):
                if any(r.body["prompt"].endswith("poison-7") for r in held):
                    raise RuntimeError("segfault-like crash")
                yield from super().run(held)

    _drive(in_process, Crashing(delay=0.0), batch.id)
    done = assert_batch_whole(fault, client, batch.id, [r["custom_id"] for r in requests])
    assert done.batch.status == "completed"
    assert done.batch.request_counts.failed == 1
    [err] = done.errs
    assert err["custom_id"] == "poison-7"
    error = err["response"]["body"]["error"]
    assert error["code"] == "max_attempts_exceeded" and "segfault-like" in error["message"]
    assert len(done.out) == len(requests) - 1
    # The crashes of runs it shared with the poison line were charged to no innocent line:
    # each used the one attempt that succeeded; the poison line used its three alone.
    tries = dict(
        fault.sql("SELECT custom_id, attempts FROM batch_requests WHERE batch_id = %s", batch.id)
    )
    assert tries.pop("poison-7") == 3
    assert set(tries.values()) == {1}, tries


def test_out_of_memory_splits_and_retries(fault: Stack, in_process: Any) -> None:
    from batchwright import control

    client = fault.client()
    requests = _lines("oom", 24, 8)
    batch = submit(client, jsonl(requests))
    control.validate_batch(batch.id)

    class OutOfMemoryError(RuntimeError):
        """Named like torch.cuda.OutOfMemoryError, which the runner recognises by name."""

    class Small(FakeEngine):
        """Runs out of memory with more than 2 rows at once, like a too-large batch."""

        max_rows = 8

        def run(self, requests: Iterable[Any], cancelled: Any = None) -> Iterator[Any]:
            from batchwright.engine.requests.types import WAKE

            lines = iter(requests)
            while True:
                held: list[Any] = []
                for req in lines:
                    if req is WAKE:
                        if held:
                            break  # the lease's last lines
                        continue
                    held.append(req)
                    if len(held) > self.max_rows:
                        break
                if not held:
                    return  # the host stops
                if self.max_rows > 2:
                    raise OutOfMemoryError("CUDA out of memory")
                yield from super().run(held)

    engine = Small(delay=0.0)
    _drive(in_process, engine, batch.id)
    assert engine.max_rows == 2
    done = assert_batch_whole(fault, client, batch.id, [r["custom_id"] for r in requests])
    assert done.batch.status == "completed"
    assert len(done.out) == len(requests)
    # Out of memory is not the lines' fault: no attempt was used up by it.
    assert attempts(fault, batch.id) == {1: len(requests)}
