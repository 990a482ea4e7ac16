"""`batchwright webhooks add|list|remove`: a project's webhook endpoints."""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from batchwright.errors import APIError

webhooks = typer.Typer(help="Webhook endpoints of a project.", no_args_is_help=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)  # one line per message


def _fail(exc: APIError) -> None:
    # A message may quote a URL such as http://[fe80::1]/, which Rich would read as a tag.
    err.print(f"[red]error:[/red] {escape(exc.message)}", soft_wrap=True)
    raise typer.Exit(2)


@webhooks.command("add")
def add(
    url: Annotated[str, typer.Argument(help="Where events are POSTed.")],
    project: Annotated[str, typer.Option(help="Project name (created if new).")] = "default",
    event: Annotated[
        list[str] | None,
        typer.Option(help="Event type to send (repeatable); default: all batch events."),
    ] = None,
) -> None:
    """Add an endpoint; its signing secret (whsec_...) is printed once, on stdout."""
    from batchwright.config import get_settings
    from batchwright.db.session import session_scope
    from batchwright.webhooks.service import add_endpoint

    try:
        with session_scope() as session:
            endpoint = add_endpoint(session, project, url, get_settings(), event)
            endpoint_id, secret = endpoint.id, endpoint.secret
    except APIError as exc:
        _fail(exc)
        return
    err.print(f"endpoint id: {endpoint_id} (the secret below is not shown again)", markup=False)
    if _private(url):
        # Deliveries check the address again, in the workers: without the setting there
        # every delivery fails for good (`webhooks list` shows it).
        err.print(
            "note: a private or loopback address: the workers need "
            "BATCHWRIGHT_WEBHOOK_ALLOW_PRIVATE_TARGETS=true too, or nothing is delivered",
            markup=False,
        )
    sys.stdout.write(secret + "\n")


def _private(url: str) -> bool:
    from batchwright.webhooks.targets import check_url

    try:
        check_url(url, allow_private=False)
    except APIError:
        return True
    return False


@webhooks.command("list")
def list_(
    project: Annotated[str | None, typer.Option(help="Only this project.")] = None,
) -> None:
    """List endpoints with their deliveries by state and the last delivery error (secrets
    are never shown again)."""
    from batchwright.db.session import session_scope
    from batchwright.webhooks.service import delivery_states, list_endpoints

    table = Table("id", "project", "url", "events", "created", "deliveries", "last error")
    with session_scope() as session:
        endpoints = list_endpoints(session, project)
        states = delivery_states(session, [endpoint.id for endpoint, _ in endpoints])
        for endpoint, project_name in endpoints:
            events = ", ".join(endpoint.event_types) if endpoint.event_types else "all"
            state = states[endpoint.id]
            deliveries = ", ".join(
                f"{state.counts[name]} {name}"
                for name in ("delivered", "pending", "failed")
                if state.counts.get(name)
            )
            table.add_row(
                endpoint.id,
                project_name,
                endpoint.url,
                events,
                _when(endpoint.created_at),
                deliveries or "none yet",
                (state.last_error or "")[:160],
            )
    Console(width=200, markup=False).print(table)


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@webhooks.command("remove")
def remove(endpoint_id: str) -> None:
    """Remove an endpoint and its pending deliveries."""
    from batchwright.db.session import session_scope
    from batchwright.webhooks.service import remove_endpoint

    try:
        with session_scope() as session:
            remove_endpoint(session, endpoint_id)
    except APIError as exc:
        _fail(exc)
    err.print(f"removed {endpoint_id}", markup=False)
