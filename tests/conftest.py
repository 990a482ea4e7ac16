"""Real services for the suite: a fresh Postgres database built by `alembic upgrade head`,
a Redis database, the API under uvicorn and Celery worker processes started here.

Outside CI a missing Postgres or Redis skips these tests; under CI=true it fails them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

# torch.compile's on-disk cache, fresh for each test run: a second run of the engine tests
# (.ci/run's ATEN_CPU_CAPABILITY=avx2 pass) reusing the first run's compiled CPU kernels hit
# one built for another vocabulary size (an index out of bounds, or a crash). Set it to
# keep one across runs.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="bw-inductor-"))

PG_ADMIN = os.environ.get("BW_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS = os.environ.get("BW_TEST_REDIS", "redis://127.0.0.1:6379/7")
CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _unavailable(what: str, exc: Exception) -> None:
    msg = f"{what} unreachable: {exc}"
    if CI:
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def create_database(prefix: str) -> str:
    """An empty Postgres database of its own, named `prefix`_<random>: its URL."""
    import psycopg

    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    try:
        with psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except Exception as exc:
        _unavailable("Postgres", exc)
    return PG_ADMIN.rsplit("/", 1)[0] + "/" + name


def drop_database(url: str) -> None:
    """Drop what create_database made, whoever is still connected."""
    import psycopg

    name = url.rsplit("/", 1)[1]
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    url = create_database("bw_test")
    yield url
    drop_database(url)


@pytest.fixture(scope="session")
def redis_url() -> str:
    import redis

    try:
        redis.Redis.from_url(REDIS, socket_timeout=5).ping()
    except Exception as exc:
        _unavailable("Redis", exc)
    return REDIS


@pytest.fixture(scope="session")
def bw_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """BATCHWRIGHT_HOME with the demo model built once, in HF format, as on first use."""
    home = tmp_path_factory.mktemp("bw_home")
    from batchwright.engine.loading.demo import build_demo_model

    build_demo_model(home / "models" / "demo")
    return home


@pytest.fixture(scope="session")
def service_env(pg_url: str, redis_url: str, bw_home: Path) -> Iterator[dict[str, str]]:
    env = {
        **os.environ,
        "BATCHWRIGHT_DATABASE_URL": pg_url,
        "BATCHWRIGHT_BROKER_URL": redis_url,
        # Own queue: several test runs may share this Redis without taking each other's work.
        "BATCHWRIGHT_QUEUE": f"bw-test-{uuid.uuid4().hex[:8]}",
        "BATCHWRIGHT_HOME": str(bw_home),
        "BATCHWRIGHT_LEASE_SECONDS": "6",
        "BATCHWRIGHT_SWEEP_INTERVAL_SECONDS": "2",
        "BATCHWRIGHT_WORK_SLICE_SECONDS": "20",
        "BATCHWRIGHT_CLAIM_BATCH_SIZE": "8",
        # Webhook receivers in tests listen on loopback; retries come quickly.
        "BATCHWRIGHT_WEBHOOK_ALLOW_PRIVATE_TARGETS": "true",
        "BATCHWRIGHT_WEBHOOK_RETRY_BASE_SECONDS": "0.2",
        "BATCHWRIGHT_WEBHOOK_TIMEOUT_SECONDS": "2",
        # Uploads over 16 MB are refused, so the limit is testable without 200 MB bodies.
        "BATCHWRIGHT_MAX_UPLOAD_BYTES": str(16 * 1024 * 1024),
        # A second name for the same weights makes `mismatched_model` testable.
        "BATCHWRIGHT_MODELS": json.dumps(
            {
                "models": {
                    name: {
                        "path": str(bw_home / "models" / "demo"),
                        "max_rows": 16,
                    }
                    for name in ("demo", "demo-b")
                }
            }
        ),
    }
    old = dict(os.environ)
    os.environ.update(env)
    _reset_caches()
    from batchwright.db.migrate import upgrade_head

    upgrade_head(pg_url)
    yield env
    os.environ.clear()
    os.environ.update(old)
    _reset_caches()


def _reset_caches() -> None:
    from batchwright.config import get_settings
    from batchwright.db.session import get_engine, get_sessionmaker

    get_settings.cache_clear()
    get_sessionmaker.cache_clear()
    get_engine.cache_clear()


class Proc:
    """A child process with its output in a log file, for readiness checks and post-mortems."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._fh = log.open("wb")
        # A session of its own: a worker and its lease process
        # (worker/generation/lease_process.py) are one process group, frozen and killed
        # together as a machine's death would.
        self.popen = subprocess.Popen(
            args, env=env, stdout=self._fh, stderr=subprocess.STDOUT, start_new_session=True
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if text in self.output():
                return
            if self.popen.poll() is not None:
                raise RuntimeError(f"process exited early:\n{self.output()[-3000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"{text!r} not seen in {self.log}:\n{self.output()[-3000:]}")

    def signal_group(self, sig: int) -> None:
        """`sig` to the process and what it started (SIGSTOP, SIGKILL: a host's failure)."""
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)

    def stop(self, sig: int = 15, timeout: float = 30) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._fh.close()
        return self.popen.returncode


StartWorker = Callable[..., Proc]


@pytest.fixture(scope="session")
def start_worker(
    service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StartWorker]:
    procs: list[Proc] = []
    logs = tmp_path_factory.mktemp("workers")

    def start(**env: str) -> Proc:
        proc = Proc(
            [sys.executable, "-m", "batchwright.cli", "worker", "--loglevel", "INFO"],
            {**service_env, **env},
            logs / f"worker-{len(procs)}.log",
        )
        procs.append(proc)
        proc.wait_for("ready.")
        return proc

    yield start
    for proc in procs:
        proc.stop()


@pytest.fixture(scope="session")
def beat(service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    logs = tmp_path_factory.mktemp("beat")
    proc = Proc(
        [sys.executable, "-m", "batchwright.cli", "beat", "--schedule", str(logs / "schedule")],
        service_env,
        logs / "beat.log",
    )
    proc.wait_for("beat: Starting")
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def worker(start_worker: StartWorker, beat: Proc) -> Proc:
    """The suite's long-lived worker (fault tests start and kill their own)."""
    return start_worker()


@pytest.fixture(scope="session")
def api_url(service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log = tmp_path_factory.mktemp("api") / "api.log"
    proc = Proc(
        [sys.executable, "-m", "batchwright.cli", "serve", "--port", str(port)], service_env, log
    )
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    else:
        raise RuntimeError(proc.output())
    yield url
    proc.stop()


def create_key(env: dict[str, str], project: str) -> str:
    """Through the real CLI command; the secret is the last line it prints."""
    out = subprocess.run(
        [sys.executable, "-m", "batchwright.cli", "keys", "create", "--project", project],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def api_key(service_env: dict[str, str]) -> str:
    return create_key(service_env, "team-a")


@pytest.fixture(scope="session")
def other_key(service_env: dict[str, str]) -> str:
    return create_key(service_env, "team-b")


@pytest.fixture(scope="session")
def client(api_url: str, api_key: str, worker: Proc):  # type: ignore[no-untyped-def]
    from openai import OpenAI

    return OpenAI(base_url=api_url + "/v1", api_key=api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def http(api_url: str, api_key: str) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=api_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60
    ) as c:
        yield c
