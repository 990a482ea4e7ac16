"""A separate stack for fault injection: its own Postgres database, Redis database and
Celery queue, one API and one beat (sweeper every 2 s) for the folder, and workers/APIs
started per test so a test can kill them without touching the suite's long-lived ones.

The Redis database defaults to db 8 (BW_TEST_FAULT_REDIS): the Redis fault tests run
FLUSHDB there, never FLUSHALL, so other users of this Redis keep their keys. The test that
restarts Redis (test_redis_restarted) restarts a Redis server of its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.conftest import (
    PG_ADMIN,
    Proc,
    _free_port,
    _unavailable,
    create_database,
    create_key,
    drop_database,
)

FAULT_REDIS = os.environ.get("BW_TEST_FAULT_REDIS", "redis://127.0.0.1:6379/8")


class Stack:
    """Starts and kills service processes; talks to the test database directly."""

    def __init__(self, env: dict[str, str], pg_url: str, logs: Path) -> None:
        self.env = env
        self.pg_url = pg_url
        self.redis_url = env["BATCHWRIGHT_BROKER_URL"]
        self.queue = env["BATCHWRIGHT_QUEUE"]
        self.logs = logs
        self.procs: list[Proc] = []
        self.api_url = ""
        self.api_key = ""

    # --- processes -----------------------------------------------------------------------

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> Proc:
        log = self.logs / f"{len(self.procs):02d}-{name}.log"
        proc = Proc([sys.executable, "-m", "batchwright.cli", *args], {**self.env, **env}, log)
        self.procs.append(proc)
        return proc

    def workers(self, n: int = 1, **env: str) -> list[Proc]:
        """Start n Celery workers at once (model loading overlaps) and wait for all."""
        procs = [self._spawn("worker", ["worker", "--loglevel", "INFO"], env) for _ in range(n)]
        for proc in procs:
            proc.wait_for("ready.")
        return procs

    def worker(self, **env: str) -> Proc:
        return self.workers(1, **env)[0]

    def api(self, **env: str) -> tuple[Proc, str]:
        port = _free_port()
        proc = self._spawn("api", ["serve", "--port", str(port)], env)
        url = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 60
        while time.monotonic() < end:
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
            if proc.popen.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(proc.output()[-3000:])

    def client(self, url: str | None = None) -> Any:
        from openai import OpenAI

        return OpenAI(
            base_url=(url or self.api_url) + "/v1",
            api_key=self.api_key,
            max_retries=0,
            timeout=60,
        )

    def kill(self, proc: Proc) -> None:
        proc.signal_group(signal.SIGKILL)
        proc.stop(signal.SIGKILL)

    # --- database ------------------------------------------------------------------------

    def sql(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.pg_url, autocommit=True, connect_timeout=5) as conn:
            cur = conn.execute(query, params)
            return list(cur.fetchall()) if cur.description else []

    def scalar(self, query: str, *params: Any) -> Any:
        rows = self.sql(query, *params)
        return rows[0][0] if rows else None

    def terminate_backends(self) -> int:
        """Drop every connection to the test database but the one asking."""
        dbname = self.pg_url.rsplit("/", 1)[1]
        with psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=5) as conn:
            rows = conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()",
                (dbname,),
            ).fetchall()
        return sum(1 for (ok,) in rows if ok)

    def clean(self) -> None:
        """What a test leaves in the stack, gone, however it ended: its unfinished batches
        cancelled with their lines (no worker may take them up in the next test), webhook
        endpoints and their deliveries, heartbeats, and the messages in this stack's queues
        (the package's sweeper fills them while no worker runs)."""
        self.sql(
            "UPDATE batch_requests SET state = 'cancelled', lease_token = NULL, "
            "lease_expires_at = NULL WHERE state IN ('queued', 'running')"
        )
        self.sql(
            "UPDATE batches SET status = 'cancelled', "
            "cancelled_at = extract(epoch FROM now())::bigint "
            "WHERE status NOT IN ('completed', 'failed', 'cancelled', 'expired')"
        )
        self.sql("DELETE FROM webhook_endpoints")  # and their deliveries (cascade)
        self.sql("DELETE FROM worker_heartbeats")
        r = self.redis()
        # The stack's own queues only (others share this Redis database).
        for key in r.scan_iter(match=f"{self.queue}*"):
            r.delete(key)

    # --- redis ---------------------------------------------------------------------------

    def redis(self) -> Any:
        import redis

        return redis.Redis.from_url(self.redis_url, socket_timeout=5)


@pytest.fixture(scope="package")
def stack(bw_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    import redis

    try:
        redis.Redis.from_url(FAULT_REDIS, socket_timeout=5).ping()
    except Exception as exc:
        _unavailable("Redis", exc)
    pg_url = create_database("bw_fault")
    env = {
        **os.environ,
        "BATCHWRIGHT_DATABASE_URL": pg_url,
        "BATCHWRIGHT_BROKER_URL": FAULT_REDIS,
        "BATCHWRIGHT_QUEUE": f"bw-fault-{uuid.uuid4().hex[:8]}",
        "BATCHWRIGHT_HOME": str(bw_home),
        "BATCHWRIGHT_LEASE_SECONDS": "6",
        "BATCHWRIGHT_SWEEP_INTERVAL_SECONDS": "2",
        "BATCHWRIGHT_WORK_SLICE_SECONDS": "20",
        "BATCHWRIGHT_CLAIM_BATCH_SIZE": "8",
        "BATCHWRIGHT_MODELS": json.dumps(
            {"models": {"demo": {"path": str(bw_home / "models" / "demo"), "max_rows": 16}}}
        ),
    }
    st = Stack(env, pg_url, tmp_path_factory.mktemp("faults"))
    subprocess.run(
        [sys.executable, "-m", "batchwright.cli", "db", "upgrade"],
        env=env,
        check=True,
        capture_output=True,
    )
    st.api_key = create_key(env, "faults")
    _, st.api_url = st.api()
    beat = st._spawn("beat", ["beat", "--schedule", str(st.logs / "schedule")], {})
    beat.wait_for("beat: Starting")
    try:
        yield st
    finally:
        for proc in st.procs:
            proc.stop(signal.SIGKILL)
        drop_database(pg_url)


@pytest.fixture
def fault(stack: Stack) -> Iterator[Stack]:
    """The stack, with every process a test starts killed when it ends (the package's
    API and beat stay) and what the test left cleaned up (Stack.clean), whether it passed
    or failed: one failure does not take the next tests down with it."""
    keep = len(stack.procs)
    yield stack
    for proc in stack.procs[keep:]:
        proc.signal_group(signal.SIGKILL)  # its lease and control processes too
        proc.stop(signal.SIGKILL)
    del stack.procs[keep:]
    stack.clean()


@pytest.fixture
def in_process(fault: Stack, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Point this process's settings at the fault database, tasks queued in memory."""
    from batchwright.config import get_settings
    from batchwright.controlplane import dispatch
    from batchwright.db.session import get_engine, get_sessionmaker

    def reset() -> None:
        get_settings.cache_clear()
        get_sessionmaker.cache_clear()
        get_engine.cache_clear()

    for key, value in fault.env.items():
        if key.startswith("BATCHWRIGHT_"):
            monkeypatch.setenv(key, value)
    reset()
    inline = dispatch.InlineDispatcher()
    monkeypatch.setattr(dispatch, "_dispatcher", inline)
    yield inline
    get_engine().dispose()
    monkeypatch.undo()
    reset()
