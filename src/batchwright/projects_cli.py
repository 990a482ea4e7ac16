"""`batchwright projects`: a project's fair-share weight and quotas."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

projects = typer.Typer(
    help="Project weights (fair share), quotas and online rate limits.", no_args_is_help=True
)
console = Console(markup=False)  # project names are anyone's text

NO_LIMIT = "Use 0 to remove the limit."
# The columns are BIGINT: a larger limit is a usage error here, not a database traceback.
MOST = 2**63 - 1


@projects.command("set")
def projects_set(
    project: Annotated[str, typer.Argument(help="Project name (created if new).")],
    weight: Annotated[
        float | None, typer.Option(min=0.01, help="Share of a model's capacity (default 1).")
    ] = None,
    max_enqueued_lines: Annotated[
        int | None, typer.Option(min=0, max=MOST, help=f"Lines in unfinished batches. {NO_LIMIT}")
    ] = None,
    max_enqueued_tokens: Annotated[
        int | None,
        typer.Option(
            min=0, max=MOST, help=f"Prompt + max_tokens of unfinished batches. {NO_LIMIT}"
        ),
    ] = None,
    online_requests_per_minute: Annotated[
        int | None,
        typer.Option(
            "--rpm",
            min=0,
            max=MOST,
            help="Online requests a minute (/v1/completions and /v1/chat/completions). " + NO_LIMIT,
        ),
    ] = None,
    online_tokens_per_minute: Annotated[
        int | None,
        typer.Option(
            "--tpm",
            min=0,
            max=MOST,
            help="Online tokens a minute (prompt + completion, both endpoints). " + NO_LIMIT,
        ),
    ] = None,
) -> None:
    """Set a project's weight, quotas and online rate limits; options left out keep their
    value. A request over a rate limit is answered 429 at once, with Retry-After."""
    from batchwright.auth.service import get_or_create_project
    from batchwright.db.session import session_scope

    with session_scope() as session:
        row = get_or_create_project(session, project)
        if weight is not None:
            row.weight = weight
        if max_enqueued_lines is not None:
            row.max_enqueued_lines = max_enqueued_lines or None
        if max_enqueued_tokens is not None:
            row.max_enqueued_tokens = max_enqueued_tokens or None
        if online_requests_per_minute is not None:
            row.online_requests_per_minute = online_requests_per_minute or None
        if online_tokens_per_minute is not None:
            row.online_tokens_per_minute = online_tokens_per_minute or None
    projects_list()


@projects.command("list")
def projects_list() -> None:
    """Projects with their weight, quotas and online rate limits."""
    from sqlalchemy import select

    from batchwright.config import get_settings
    from batchwright.db.models import Project
    from batchwright.db.session import session_scope

    table = Table(
        "project",
        "id",
        "weight",
        "max enqueued lines",
        "max enqueued tokens",
        "online requests/min",
        "online tokens/min",
    )
    default = get_settings().default_project_weight
    with session_scope() as session:
        for row in session.scalars(select(Project).order_by(Project.name)):
            table.add_row(
                row.name,
                row.id,
                f"{row.weight if row.weight is not None else default:g}",
                str(row.max_enqueued_lines or "-"),
                str(row.max_enqueued_tokens or "-"),
                str(row.online_requests_per_minute or "-"),
                str(row.online_tokens_per_minute or "-"),
            )
    console.print(table)
