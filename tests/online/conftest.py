"""A stack of its own for the online endpoint's tests (tests/shared's, with a short queue
timeout and a 1 MiB JSON body cap); workers are started per test and stopped after."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import _free_port
from tests.shared.conftest import Service, run_service, svc  # noqa: F401  (fixtures)

QUEUE_TIMEOUT = 3.0
BODY_CAP = 1 << 20


@pytest.fixture(scope="package")
def service(bw_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    yield from run_service(
        bw_home,
        tmp_path_factory,
        BATCHWRIGHT_ONLINE_QUEUE_TIMEOUT_SECONDS=str(QUEUE_TIMEOUT),
        BATCHWRIGHT_MAX_JSON_BODY_BYTES=str(BODY_CAP),
        # /metrics on a listener of its own (the API's port serves it to no one here).
        BATCHWRIGHT_METRICS_PORT=str(_free_port()),
    )
