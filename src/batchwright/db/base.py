"""Declarative base and id helpers shared by every table."""

from __future__ import annotations

import secrets
import time

from sqlalchemy import MetaData
from sqlalchemy.orm import DeclarativeBase

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


def new_id(prefix: str, nbytes: int = 5) -> str:
    """Time-ordered ids (microseconds, then randomness): lists page stably within a second."""
    return f"{prefix}{time.time_ns() // 1000:014x}{secrets.token_hex(nbytes)}"


def now() -> int:
    return int(time.time())
