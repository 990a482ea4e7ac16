"""Killing a worker while it holds leases: a condition, never a moment in time."""

from __future__ import annotations

import signal
import time

from tests.conftest import Proc
from tests.faults.conftest import Stack


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
