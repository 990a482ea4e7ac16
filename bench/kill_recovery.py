"""Cost of worker deaths: the same 2,000-line batch with no fault and with 8 SIGKILLs.

Runs tests/faults/test_kills.py (real Postgres, Redis, API, beat and Celery workers) once
per kill count and prints its figure lines: lines completed, attempts per line, runs lost
per line and the time from the first worker's start to the batch being complete (each
kill also costs a worker start, as a real restart would). Needs what the fault suite
needs (BW_TEST_FAULT_REDIS etc.). Usage: python bench/kill_recovery.py [--lines N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(kills: int, lines: int) -> str:
    env = {**os.environ, "BW_KILL_COUNT": str(kills), "BW_KILL_LINES": str(lines)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
            "tests/faults/test_kills.py",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    figures = [ln for ln in out.stdout.splitlines() if "kills:" in ln]
    if out.returncode != 0 or not figures:
        return f"{kills} kills: FAILED\n{out.stdout[-3000:]}"
    return figures[-1][figures[-1].index("kills:") :]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--kills", type=int, nargs="+", default=[0, 8])
    args = ap.parse_args()
    for kills in args.kills:
        print(run(kills, args.lines), flush=True)


if __name__ == "__main__":
    main()
