"""A missing or broken models file: one line naming the file and the problem."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BROKEN = {
    # The old example's mistake: dotted names unquoted make nested tables.
    "nested.toml": ('[models.qwen2.5-0.5b]\npath = "/models/q"\n', "has no 'path'"),
    "syntax.toml": ("[models\n", "line 1"),
    "badvalue.toml": ('[models."a"]\npath = "/m"\nmax_rows = "many"\n', "max_rows"),
}


def run(command: str, models_file: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWRIGHT_")}
    env["BATCHWRIGHT_MODELS_FILE"] = str(models_file)
    return subprocess.run(
        [sys.executable, "-m", "batchwright.cli", command],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("command", ["worker", "serve"])
def test_missing_models_file(command: str, tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    out = run(command, missing)
    assert out.returncode == 2
    assert out.stderr.strip() == f"error: model registry {missing}: file not found"


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_invalid_models_file(name: str, tmp_path: Path) -> None:
    text, problem = BROKEN[name]
    path = tmp_path / name
    path.write_text(text)
    out = run("worker", path)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and problem in lines[0], out.stderr
    assert "Traceback" not in out.stderr
