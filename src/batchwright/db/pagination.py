"""Cursor pagination on (created_at, id), the OpenAI `after` + `limit` style."""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

from sqlalchemy import Select, and_, or_
from sqlalchemy.orm import Session


class Paged(Protocol):
    id: Any
    created_at: Any


T = TypeVar("T", bound=Paged)


def page(
    session: Session,
    model: type[T],
    query: Select[Any],
    *,
    cursor: T | None,
    limit: int,
    desc: bool = True,
) -> tuple[list[T], bool]:
    """Rows after `cursor` in (created_at, id) order, and whether more follow."""
    created, ident = model.created_at, model.id
    if cursor is not None:
        if desc:
            query = query.where(
                or_(
                    created < cursor.created_at,
                    and_(created == cursor.created_at, ident < cursor.id),
                )
            )
        else:
            query = query.where(
                or_(
                    created > cursor.created_at,
                    and_(created == cursor.created_at, ident > cursor.id),
                )
            )
    order = (created.desc(), ident.desc()) if desc else (created.asc(), ident.asc())
    rows: list[T] = list(session.scalars(query.order_by(*order).limit(limit + 1)))
    return rows[:limit], len(rows) > limit
