"""A worker killed in the middle of a webhook delivery loses nothing: its claim runs out and
the sweeper re-sends the outbox row, with the same webhook-id, to a worker that is alive."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from openai import OpenAI

from tests.faults.conftest import Stack
from tests.receiver import receiver

HOOK_ENV = {
    "BATCHWRIGHT_WEBHOOK_ALLOW_PRIVATE_TARGETS": "true",
    "BATCHWRIGHT_WEBHOOK_TIMEOUT_SECONDS": "2",
}


def test_worker_killed_mid_delivery(fault: Stack) -> None:
    client = fault.client()
    with receiver() as hook:
        out = subprocess.run(
            [sys.executable, "-m", "batchwright.cli", "webhooks", "add", hook.url,
             "--project", "faults"],
            env={**fault.env, **HOOK_ENV}, check=True, capture_output=True, text=True,
        )  # fmt: skip
        secret = out.stdout.strip()
        hook.hold.set()  # the first request is held open: the sender is mid-delivery
        first = fault.worker(**HOOK_ENV)
        f = client.files.create(file=("bad.jsonl", b"{not json\n"), purpose="batch")
        batch = client.batches.create(
            input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
        )
        hook.wait_for(1)
        state = fault.sql("SELECT state, attempts, claimed_until FROM webhook_deliveries")
        assert [(s, a) for s, a, _ in state] == [("pending", 0)] and state[0][2] is not None
        first.stop(signal.SIGKILL)
        hook.hold.clear()
        hook.release.set()
        fault.worker(**HOOK_ENV)
        got = hook.wait_for(2)
        end = time.monotonic() + 60
        while fault.scalar("SELECT state FROM webhook_deliveries") != "delivered":
            assert time.monotonic() < end
            time.sleep(0.2)
    assert got[0].headers["webhook-id"] == got[1].headers["webhook-id"]
    assert got[1].answered == 200
    event = OpenAI(api_key="unused").webhooks.unwrap(got[1].body, got[1].headers, secret=secret)
    assert (event.type, event.data.id) == ("batch.failed", batch.id)
