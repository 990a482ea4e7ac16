"""A stack of its own for the shared-service tests: own Postgres database, own Celery
queues (on BW_TEST_REDIS, never flushed here), an API and a sweeper; workers are started
per test with the arguments each test needs (--models, --control-only) and killed after.
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
    REDIS,
    Proc,
    _free_port,
    _unavailable,
    create_database,
    create_key,
    drop_database,
)
from tests.helpers import wait_until

METRICS_KEY = "bw-test-metrics-key"
METRICS = {"Authorization": f"Bearer {METRICS_KEY}"}


class Service:
    def __init__(self, env: dict[str, str], pg_url: str, logs: Path) -> None:
        self.env = env
        self.pg_url = pg_url
        self.logs = logs
        self.procs: list[Proc] = []
        self.api_url = ""

    def spawn(self, name: str, args: list[str], **env: str) -> Proc:
        log = self.logs / f"{len(self.procs):02d}-{name}.log"
        proc = Proc([sys.executable, "-m", "batchwright.cli", *args], {**self.env, **env}, log)
        self.procs.append(proc)
        return proc

    def workers(self, *arg_lists: list[str], **env: str) -> list[Proc]:
        """Start workers at once (model loading overlaps), each with its own arguments."""
        procs = [
            self.spawn("worker", ["worker", "--loglevel", "INFO", *args], **env)
            for args in arg_lists
        ]
        for proc in procs:
            proc.wait_for("ready.")
        return procs

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "batchwright.cli", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def client(self, key: str) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.api_url + "/v1", api_key=key, max_retries=0, timeout=60)

    def key(self, project: str) -> str:
        return create_key(self.env, project)

    def sql(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.pg_url, autocommit=True, connect_timeout=5) as conn:
            cur = conn.execute(query, params)
            return list(cur.fetchall()) if cur.description else []

    def wait(self, condition: Any, timeout: float = 240, what: str = "condition") -> Any:
        return wait_until(condition, what, timeout, every=0.2)


@pytest.fixture(scope="package")
def service(bw_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    yield from run_service(bw_home, tmp_path_factory)


def run_service(
    bw_home: Path, tmp_path_factory: pytest.TempPathFactory, **extra_env: str
) -> Iterator[Service]:
    """A stack (database, queue names, API, sweeper) for a test package; `extra_env`
    adds or overrides settings of every process it starts."""
    import redis

    try:
        redis.Redis.from_url(REDIS, socket_timeout=5).ping()
    except Exception as exc:
        _unavailable("Redis", exc)
    pg_url = create_database("bw_shared")
    model = {"path": str(bw_home / "models" / "demo"), "max_rows": 16}
    env = {
        **os.environ,
        "BATCHWRIGHT_DATABASE_URL": pg_url,
        "BATCHWRIGHT_BROKER_URL": REDIS,
        "BATCHWRIGHT_QUEUE": f"bw-shared-{uuid.uuid4().hex[:8]}",
        "BATCHWRIGHT_HOME": str(bw_home),
        "BATCHWRIGHT_LEASE_SECONDS": "6",
        "BATCHWRIGHT_SWEEP_INTERVAL_SECONDS": "2",
        "BATCHWRIGHT_WORK_SLICE_SECONDS": "20",
        "BATCHWRIGHT_CLAIM_BATCH_SIZE": "8",
        "BATCHWRIGHT_HEARTBEAT_SECONDS": "1",
        # /metrics and /readyz's capacity on the API's port answer only this key.
        "BATCHWRIGHT_METRICS_KEY": METRICS_KEY,
        # Two names, two models as far as routing is concerned (same weights on disk).
        "BATCHWRIGHT_MODELS": json.dumps({"models": {"demo": model, "demo-b": model}}),
        **extra_env,
    }
    svc = Service(env, pg_url, tmp_path_factory.mktemp("shared"))
    out = svc.cli("db", "upgrade")
    assert out.returncode == 0, out.stderr
    port = _free_port()
    api = svc.spawn("api", ["serve", "--port", str(port)])
    svc.api_url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 60
    while True:
        try:
            if httpx.get(svc.api_url + "/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > end or api.popen.poll() is not None:
            raise RuntimeError(api.output()[-3000:])
        time.sleep(0.2)
    beat = svc.spawn("beat", ["beat", "--schedule", str(svc.logs / "schedule")])
    beat.wait_for("beat: Starting")
    try:
        yield svc
    finally:
        for proc in svc.procs:
            proc.stop(signal.SIGKILL)
        drop_database(pg_url)


@pytest.fixture
def svc(service: Service) -> Iterator[Service]:
    """The service; workers a test starts are killed when it ends (API and beat stay)."""
    keep = len(service.procs)
    yield service
    for proc in service.procs[keep:]:
        proc.stop(signal.SIGTERM, timeout=20)
    del service.procs[keep:]
    service.sql("DELETE FROM worker_heartbeats")


@pytest.fixture(scope="package")
def no_torch(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A PYTHONPATH entry that makes `import torch` fail: a control-only worker must not care."""
    root = tmp_path_factory.mktemp("no_torch")
    (root / "torch").mkdir()
    (root / "torch" / "__init__.py").write_text(
        "raise ImportError('torch is blocked in this process (control-only worker test)')\n"
    )
    return str(root)
