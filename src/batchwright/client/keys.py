"""`batchwright keys list`: an operator's view of the keys, read from the service database
(BATCHWRIGHT_DATABASE_URL), like `keys create` and `keys revoke`; secrets are never stored."""

from __future__ import annotations

from batchwright.client.common import Json, print_json, table, when


def keys_list(as_json: Json = False) -> None:
    """List API keys: id, project, label, the secret's first characters, state."""
    from sqlalchemy import select

    from batchwright.db.models import APIKey, Project
    from batchwright.db.session import session_scope

    with session_scope() as session:
        rows = session.execute(
            select(APIKey, Project.name)
            .join(Project, Project.id == APIKey.project_id)
            .order_by(APIKey.created_at, APIKey.id)
        ).all()
        keys = [
            {
                "id": key.id,
                "project": project,
                "name": key.name,
                "prefix": key.prefix + "…",
                "created_at": key.created_at,
                "revoked_at": key.revoked_at,
            }
            for key, project in rows
        ]
        cells = [
            (
                key.id,
                project,
                key.name,
                key.prefix + "…",
                when(key.created_at),
                when(key.revoked_at) if key.revoked_at else "",
            )
            for key, project in rows
        ]
    if as_json:
        print_json({"object": "list", "data": keys})
        return
    table(["id", "project", "name", "prefix", "created", "revoked"], cells)
