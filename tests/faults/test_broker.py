"""The broker only wakes workers: emptied or restarted, it must lose nothing."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from tests.faults.checks import assert_batch_whole
from tests.faults.conftest import Stack
from tests.faults.test_workers import _lines
from tests.helpers import held_mid_batch, jsonl, submit

# How .ci/run starts the machine's Redis (docs/DESIGN §6); restarted with the same line.
REDIS_START = [
    "redis-server",
    "--daemonize",
    "yes",
    "--bind",
    "127.0.0.1",
    "-::1",
    "--port",
    "6379",
    "--save",
    "",
    "--appendonly",
    "no",
    "--dir",
    "/var/lib/redis",
    "--logfile",
    "/var/log/redis/ci.log",
]


def test_redis_flushed(fault: Stack) -> None:
    """FLUSHDB on the fault Redis db (not FLUSHALL: other users of this Redis keep theirs).

    A short work slice makes the worker end its task and re-send itself every second, so
    after the flush the batch only finishes if sends still reach the worker's queue."""
    client = fault.client()
    r = fault.redis()
    requests = _lines("flush", 300, 64)
    batch = submit(client, jsonl(requests))
    r.flushdb()  # the validate message is gone before any worker saw it
    worker = fault.worker(BATCHWRIGHT_WORK_SLICE_SECONDS="1")
    with held_mid_batch(fault.pg_url, batch.id) as before:
        r.flushdb()  # mid-batch: queued and unacked messages, queue bindings, all gone
        mark = len(worker.output())
    done = assert_batch_whole(fault, client, batch.id, [r["custom_id"] for r in requests])
    assert done.batch.status == "completed"
    assert len(done.out) == len(requests)
    resent = worker.output()[mark:].count("batchwright.process[")
    assert resent > 0  # work after the flush came from messages sent after it
    print(
        f"redis flushed: {before} lines done at the second flush, {len(done.out)} at the "
        f"end, {resent} process log lines after the flush"
    )


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server here")
def test_redis_restarted(fault: Stack) -> None:
    client = fault.client()
    fault.worker(BATCHWRIGHT_WORK_SLICE_SECONDS="1")
    requests = _lines("restart", 300, 64)
    batch = submit(client, jsonl(requests))
    with held_mid_batch(fault.pg_url, batch.id) as before:
        try:
            subprocess.run(["redis-cli", "-p", "6379", "shutdown", "nosave"], timeout=10)
            time.sleep(0.5)
        finally:
            subprocess.run(REDIS_START, check=True, timeout=10)
    end = time.monotonic() + 10
    while True:
        try:
            fault.redis().ping()
            break
        except Exception:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)
    done = assert_batch_whole(fault, client, batch.id, [r["custom_id"] for r in requests])
    assert done.batch.status == "completed"
    assert len(done.out) == len(requests)
    print(f"redis restarted: {before} lines done before, {len(done.out)} at the end")
