"""The package's structure (issue 22, item 5): the layers contract in pyproject.toml holds,
no import circles (type-only imports included), and persistence knows no feature."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_layers_and_no_cycles_contracts_hold() -> None:
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run(
        [str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_opening_a_session_installs_no_feature_hook() -> None:
    """The outbox's hook is the composing process's to install: importing persistence (or
    opening a session) neither imports the webhooks package nor registers its hook."""
    code = (
        "import sys\n"
        "from sqlalchemy import event\n"
        "from sqlalchemy.orm import Session\n"
        "from batchwright.db.session import get_sessionmaker\n"
        "get_sessionmaker('sqlite://')().close()\n"
        "assert 'batchwright.webhooks.outbox' not in sys.modules, 'outbox imported'\n"
        "from batchwright.webhooks import outbox\n"
        "assert not event.contains(Session, 'before_flush', outbox._on_flush)\n"
        "outbox.install(); outbox.install()\n"
        "assert event.contains(Session, 'before_flush', outbox._on_flush)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
