"""The broker only wakes workers: emptied or restarted, it must lose nothing."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

from tests.conftest import _free_port
from tests.faults.checks import PATIENCE, assert_batch_whole
from tests.faults.conftest import Stack
from tests.faults.test_workers import _lines
from tests.helpers import held_mid_batch, jsonl, submit


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


class RedisServer:
    """A Redis server of the test's own on a free port: restarting it disturbs no one else
    (the machine's Redis on 6379 serves every other test running meanwhile)."""

    def __init__(self, workdir: Path) -> None:
        self.port = _free_port()
        self.workdir = workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        with (self.workdir / "redis.log").open("ab") as log:
            self.popen = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        client = redis.Redis.from_url(self.url, socket_timeout=5)
        end = time.monotonic() + 30
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                assert self.popen.poll() is None, (self.workdir / "redis.log").read_text()
                assert time.monotonic() < end, "redis-server did not answer"
                time.sleep(0.05)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()  # SIGTERM: Redis shuts down (nothing to save)
            self.popen.wait(30)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server here")
def test_redis_restarted(fault: Stack, tmp_path: Path) -> None:
    """The broker restarted mid-batch (its queues lost with it): the batch completes."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        broker = {"BATCHWRIGHT_BROKER_URL": server.url}
        _, url = fault.api(**broker)
        client = fault.client(url)
        sweeper = fault._spawn("beat", ["beat", "--schedule", str(tmp_path / "schedule")], broker)
        sweeper.wait_for("beat: Starting")
        worker = fault.worker(BATCHWRIGHT_WORK_SLICE_SECONDS="1", **broker)
        requests = _lines("restart", 300, 64)
        batch = submit(client, jsonl(requests))
        with held_mid_batch(fault.pg_url, batch.id) as before:
            server.stop()  # mid-batch: its queues, and every client's connection, gone
        # Down until the worker has seen its broker go (Celery's consumer says so), not for
        # a time that hopes it has; then back, empty. Outside the hold: a generation slice
        # that waits for its results to land holds the solo pool's consumer until it ends.
        worker.wait_for("consumer: Connection to broker lost", timeout=PATIENCE)
        server.start()
        done = assert_batch_whole(fault, client, batch.id, [r["custom_id"] for r in requests])
        assert done.batch.status == "completed"
        assert len(done.out) == len(requests)
        print(f"redis restarted: {before} lines done before, {len(done.out)} at the end")
    finally:
        server.stop()
