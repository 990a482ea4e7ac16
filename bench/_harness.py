"""Shared set-up for the service benches: a throwaway Postgres database, the demo model,
batches submitted through the service's own functions (no HTTP, no broker)."""

from __future__ import annotations

import os
import random
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

PG_ADMIN = os.environ.get("BW_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def reset_caches() -> None:
    from batchwright.config import get_settings
    from batchwright.db.session import get_engine, get_sessionmaker

    get_settings.cache_clear()
    get_sessionmaker.cache_clear()
    get_engine.cache_clear()


@contextmanager
def temp_database(**settings: str) -> Iterator[str]:
    """A fresh Postgres database at head, with the process's settings pointed at it."""
    import psycopg

    name = f"bw_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = PG_ADMIN.rsplit("/", 1)[0] + "/" + name
    old = dict(os.environ)
    os.environ["BATCHWRIGHT_DATABASE_URL"] = url
    os.environ.pop("BATCHWRIGHT_BROKER_URL", None)
    for key, value in settings.items():
        os.environ[f"BATCHWRIGHT_{key.upper()}"] = value
    reset_caches()
    from batchwright.controlplane.dispatch import InlineDispatcher, set_dispatcher
    from batchwright.db.migrate import upgrade_head

    upgrade_head(url)
    set_dispatcher(InlineDispatcher())
    try:
        yield url
    finally:
        from batchwright.db.session import get_engine

        get_engine().dispose()
        os.environ.clear()
        os.environ.update(old)
        reset_caches()
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def private_redis() -> Iterator[str]:
    """A redis-server of the bench's own on a free loopback port; its URL."""
    import socket
    import subprocess
    import time

    import redis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    workdir = tempfile.mkdtemp(prefix="bw-bench-redis-")
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    proc = subprocess.Popen(
        [*args, "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url, socket_timeout=5)
        for _ in range(600):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def demo_home() -> Path:
    """BATCHWRIGHT_HOME with the demo model built (once per bench run)."""
    from batchwright.engine.loading.demo import build_demo_model

    home = Path(tempfile.mkdtemp(prefix="bw-bench-"))
    build_demo_model(home / "models" / "demo")
    return home


def demo_lines(n: int, model: str = "demo", *, max_tokens: int = 16, seed: int = 0) -> list[Any]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "seven", "quiet"]
    return [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": model,
                "prompt": " ".join(rng.choice(words) for _ in range(rng.randint(4, 24))),
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        }
        for i in range(n)
    ]


def submit(project: str, lines: list[Any]) -> str:
    """Upload `lines` and create a batch for `project` (validation left to the caller)."""
    from batchwright.auth.service import get_or_create_project
    from batchwright.batches import service
    from batchwright.config import get_settings
    from batchwright.db.session import session_scope
    from batchwright.files.service import new_file
    from batchwright.files.storage import ChunkWriter
    from batchwright.protocol.batches import CreateBatch

    settings = get_settings()
    with session_scope() as session:
        proj = get_or_create_project(session, project)
        file = new_file(session, proj.id, "input.jsonl", "batch")
        writer = ChunkWriter(session, file, settings.file_chunk_bytes)
        writer.write(b"".join(orjson.dumps(x) + b"\n" for x in lines))
        writer.close()
        batch = service.create_batch(
            session,
            proj.id,
            CreateBatch(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"),
            settings,
        )
        return batch.id


def done_lines(batch_id: str) -> int:
    from sqlalchemy import func, select

    from batchwright.db.models import BatchRequest
    from batchwright.db.session import session_scope

    with session_scope() as session:
        return int(
            session.scalar(
                select(func.count()).where(
                    BatchRequest.batch_id == batch_id,
                    BatchRequest.state.in_(("succeeded", "failed")),
                )
            )
            or 0
        )
