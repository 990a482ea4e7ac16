from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from batchwright.db import models  # noqa: F401  (registers tables)
from batchwright.db.base import Base
from batchwright.db.session import get_engine

target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = context.config.get_main_option("sqlalchemy.url") or None
    with get_engine(url).connect() as conn:
        _run(conn)


if context.is_offline_mode():
    raise SystemExit("offline migrations are not supported")
run_migrations_online()
