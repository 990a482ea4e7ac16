"""A stack of its own for the worker side of online requests (tests/shared's): a queue
timeout long enough for a request to outlive its first worker, and a worker liveness
that lasts a few seconds past a SIGSTOP (the tests freeze workers to place a request)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.shared.conftest import Service, run_service, svc  # noqa: F401  (fixtures)

WORKER_TTL = 6.0


@pytest.fixture(scope="package")
def service(bw_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    yield from run_service(
        bw_home,
        tmp_path_factory,
        BATCHWRIGHT_ONLINE_QUEUE_TIMEOUT_SECONDS="120",
        BATCHWRIGHT_ONLINE_WORKER_TTL_SECONDS=str(WORKER_TTL),
    )
