"""Killing a worker while it holds leases: a condition, never a moment in time."""

from __future__ import annotations

import signal
import time

from tests.conftest import Proc
from tests.faults.conftest import Stack


def kill_holding(fault: Stack, proc: Proc, batch_id: str, timeout: float = 240) -> int:
    """SIGKILL `proc` while it holds leased rows of `batch_id`; return how many it held.

    The worker is frozen (SIGSTOP) before its rows are counted, so the count is what it
    held when it died; if it held none at that instant it is thawed and watched again.
    `proc` must be the only live worker (rows of workers killed before have lease tokens
    of their own, left out here by their expiry being in the past or their token)."""
    dead = {
        token
        for (token,) in fault.sql(
            "SELECT DISTINCT lease_token FROM batch_requests "
            "WHERE batch_id = %s AND state = 'running'",
            batch_id,
        )
    }
    query = (
        "SELECT count(*) FROM batch_requests WHERE batch_id = %s AND state = 'running' "
        "AND lease_token <> ALL(%s::text[])"
    )
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.popen.poll() is None, proc.output()[-2000:]
        if fault.scalar(query, batch_id, list(dead)):
            proc.popen.send_signal(signal.SIGSTOP)
            held = int(fault.scalar(query, batch_id, list(dead)))
            if held:
                fault.kill(proc)
                return held
            proc.popen.send_signal(signal.SIGCONT)
        time.sleep(0.02)
    raise TimeoutError(f"the worker never held rows of {batch_id}")
