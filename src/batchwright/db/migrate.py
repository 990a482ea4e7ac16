"""Programmatic `alembic upgrade head`, used by the embedded default and the tests."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from batchwright.db.session import get_engine

# migrations/ sits at the repository root (design card), three levels above this package.
MIGRATIONS = Path(__file__).resolve().parents[3] / "migrations"


def upgrade_head(url: str | None = None) -> None:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with get_engine(url).begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
