"""A service test that cannot reach Postgres or Redis skips on a laptop and fails under CI
(CI=true, as .ci/run sets): a CI run whose servers are down must not pass by skipping."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLOSED = "127.0.0.1:1"  # nothing listens on port 1
# One test that needs Postgres (the service stack's database comes first) and one that
# needs only Redis (the relay's).
TESTS = {
    "Postgres": "tests/service/test_validation.py::test_not_json",
    "Redis": "tests/online/relay/test_relay.py::test_each_request_is_taken_by_exactly_one_worker",
}


@pytest.mark.parametrize("ci, outcome", [("true", "2 errors"), ("", "2 skipped")])
def test_unreachable_servers_fail_under_ci_and_skip_elsewhere(ci: str, outcome: str) -> None:
    env = {
        **os.environ,
        "CI": ci,
        "BW_TEST_PG": f"postgresql://postgres@{CLOSED}/postgres",
        "BW_TEST_REDIS": f"redis://{CLOSED}/7",
        "BW_TEST_FAULT_REDIS": f"redis://{CLOSED}/8",
        "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), "src"])),
    }
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rsE", "-p", "no:cacheprovider", *TESTS.values()],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout + run.stderr
    assert outcome in out, out[-3000:]
    assert run.returncode == (1 if ci else 0), out[-3000:]
    for what in TESTS:
        assert f"{what} unreachable" in out, out[-3000:]
