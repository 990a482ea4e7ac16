"""Database errors a person can fix, said in one line that names the database and the fix
(the operator commands print it instead of SQLAlchemy's traceback)."""

from __future__ import annotations

from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from batchwright.db.session import normalize_url


def _where(url: str) -> tuple[str, str]:
    """(what to call the database in a message, a `createdb` command that makes it)."""
    parsed = make_url(normalize_url(url))
    if parsed.get_backend_name() == "sqlite":
        return f"the SQLite database {parsed.database}", ""
    host, port = parsed.host or "localhost", parsed.port or 5432
    user = f" -U {parsed.username}" if parsed.username else ""
    return (
        f'the database "{parsed.database}" on {host}:{port}',
        f"createdb -h {host} -p {port}{user} {parsed.database}",
    )


def explain(exc: SQLAlchemyError, url: str) -> str:
    """One line for a database error, without the driver's paragraphs."""
    text = str(getattr(exc, "orig", None) or exc)
    low = text.lower()
    name, createdb = _where(url)
    if "database" in low and "does not exist" in low:
        return f"{name} does not exist: create it (`{createdb}`), then `batchwright db upgrade`"
    if "no such table" in low:
        return (
            f"{name} has no tables yet: for a service's database export "
            "BATCHWRIGHT_DATABASE_URL; for this one run `batchwright db upgrade` first"
        )
    if "relation" in low and "does not exist" in low:
        return f"{name} has no tables yet: run `batchwright db upgrade` first"
    if "password authentication failed" in low or ("role" in low and "does not exist" in low):
        return f"{name} refused the user: {_first(text)} (BATCHWRIGHT_DATABASE_URL)"
    if "refused" in low or "could not connect" in low or "timeout" in low:
        why = "connection refused" if "refused" in low else _first(text)
        return f"cannot reach {name} ({why}); is Postgres running? (BATCHWRIGHT_DATABASE_URL)"
    return f"{name}: {_first(text)}"


def _first(text: str) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    # psycopg prefixes the server's own words with where it tried.
    return line.split("FATAL:", 1)[-1].strip()[:200]
