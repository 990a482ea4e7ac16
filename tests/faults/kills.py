"""Killing a worker while it holds leases: a condition, never a moment in time."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from tests.conftest import Proc
from tests.faults.checks import PATIENCE
from tests.faults.conftest import Stack

_FINISHED = (
    "SELECT count(*) FROM batch_requests WHERE batch_id = %s AND state IN ('succeeded', 'failed')"
)


@contextmanager
def results_held(fault: Stack) -> Iterator[psycopg.Connection]:
    """No result can land while this is open (a SHARE lock on completions blocks the
    writers' COPY), so no line leaves `running` and no worker can finish a batch alone."""
    with psycopg.connect(fault.pg_url, connect_timeout=5) as conn:
        conn.execute("LOCK TABLE completions IN SHARE MODE")
        yield conn
        conn.rollback()


@contextmanager
def held_mid_batch(fault: Stack, batch_id: str, at_least: int = 1) -> Iterator[int]:
    """Results held (see results_held) from a moment the batch has at least `at_least`
    finished lines; yields how many. However fast the engine, the batch is mid-way until the
    block ends: looking first and holding after could find it done (at CPU speeds a
    100-line batch takes a fraction of a second)."""
    end = time.monotonic() + PATIENCE
    while True:
        with results_held(fault) as conn:
            row = conn.execute(_FINISHED, (batch_id,)).fetchone()
            done = int(row[0]) if row else 0
            if done >= at_least:
                yield done
                return
        assert time.monotonic() < end, f"{batch_id}: {done} of {at_least} lines finished"
        time.sleep(0.05)


def kill_holding(
    fault: Stack, proc: Proc, batch_id: str, dead: set[str] | None = None, timeout: float = 240
) -> int:
    """SIGKILL `proc` while it holds leased rows of `batch_id`; return how many it held.

    The worker is frozen (SIGSTOP) before its rows are counted, so the count is what it
    held when it died; if it held none at that instant it is thawed and watched again.
    `proc` must be the only live worker; `dead` collects the lease tokens of the workers
    killed so far (their rows stay `running` until the sweeper re-queues them), so pass
    the same set to successive calls."""
    dead = set() if dead is None else dead
    query = (
        "SELECT lease_token FROM batch_requests WHERE batch_id = %s AND state = 'running' "
        "AND lease_token <> ALL(%s::text[])"
    )
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.popen.poll() is None, proc.output()[-2000:]
        if fault.sql(query, batch_id, list(dead)):
            proc.signal_group(signal.SIGSTOP)
            tokens = [t for (t,) in fault.sql(query, batch_id, list(dead))]
            if tokens:
                fault.kill(proc)
                dead.update(tokens)
                return len(tokens)
            proc.signal_group(signal.SIGCONT)
        time.sleep(0.02)
    raise TimeoutError(f"the worker never held rows of {batch_id}")
