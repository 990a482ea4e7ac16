"""The `batchwright` command."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console

from batchwright import client
from batchwright.adapters_cli import adapters as adapters_cli
from batchwright.errors import NotFound
from batchwright.projects_cli import projects
from batchwright.webhooks.cli import webhooks as webhooks_cli

# Keep this module's imports light: every command pays them (bench/startup.py measures).
app = typer.Typer(
    cls=client.ClientGroup,
    help="Self-hosted, OpenAI-compatible batch inference.",
    no_args_is_help=True,
)
keys = typer.Typer(help="Create and revoke API keys.", no_args_is_help=True)
db = typer.Typer(help="Database schema.", no_args_is_help=True)
app.add_typer(keys, name="keys")
app.add_typer(db, name="db")
app.add_typer(projects, name="projects")
app.add_typer(webhooks_cli, name="webhooks")
app.add_typer(adapters_cli, name="adapters")
client.register(app, keys)
console = Console()


def _embedded_database_note() -> None:
    """The operator commands work on the service's database; in a shell without its export
    they would quietly use the embedded SQLite, so they say so (on stderr)."""
    from batchwright.config import get_settings

    settings = get_settings()
    if not settings.database_url:
        Console(stderr=True, soft_wrap=True).print(
            "note: BATCHWRIGHT_DATABASE_URL is not set: using the embedded SQLite at "
            f"{settings.home / 'batchwright.sqlite3'}, not a service's database",
            highlight=False,
            markup=False,
        )


for _group in (keys, db, projects, webhooks_cli):
    _group.callback()(_embedded_database_note)


def _check_registry() -> None:
    """A missing or broken models file: one line naming it and the problem, exit 2."""
    from batchwright.registry import RegistryError, load_registry

    try:
        load_registry()
    except RegistryError as exc:
        # markup=False: messages quote TOML such as [models."qwen2.5-0.5b"].
        Console(stderr=True).print(f"error: {exc}", highlight=False, soft_wrap=True, markup=False)
        raise typer.Exit(2) from None


def _require_service_urls(command: str) -> None:
    """The service commands need Postgres and a broker: without them `serve` would run on
    the embedded SQLite with no queue and every batch would wait for ever, unexplained."""
    from batchwright.config import get_settings

    settings = get_settings()
    missing = [
        f"BATCHWRIGHT_{name.upper()}"
        for name in ("database_url", "broker_url")
        if not getattr(settings, name)
    ]
    if missing:
        Console(stderr=True).print(
            f"error: `batchwright {command}` needs BATCHWRIGHT_DATABASE_URL and "
            f"BATCHWRIGHT_BROKER_URL; not set: {', '.join(missing)} (export both in this "
            'shell, as in the README\'s "Running the service"; `batchwright run FILE` needs '
            "neither)",
            highlight=False,
            soft_wrap=True,
            markup=False,
        )
        raise typer.Exit(2)


def _check_adapters() -> None:
    """The registry's LoRA adapters of the models this worker serves, checked against
    their bases as `adapters add` checks one: a malformed one stops the worker in one
    line (a base whose files are not built yet, the demo's, is checked at first use)."""
    from batchwright.adapter_files import AdapterError, check
    from batchwright.controlplane.routing import served_models
    from batchwright.registry import load_registry

    registry = load_registry()
    try:
        served = set(served_models(registry=registry))
    except ValueError:
        return  # worker_queues says why, in its line
    for name, adapter in sorted(registry.adapters.items()):
        spec = registry.get(adapter.base)
        if spec is None or adapter.base not in served or not (spec.path / "config.json").exists():
            continue
        try:
            check(adapter.adapter, spec.path, spec.max_lora_rank)
        except AdapterError as exc:
            Console(stderr=True).print(
                f"error: adapter {name!r}: {exc}", highlight=False, soft_wrap=True
            )
            raise typer.Exit(2) from None


@app.command()
def run(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True)],
    output: Annotated[Path | None, typer.Option(help="Default: FILE.output.jsonl.")] = None,
    errors: Annotated[Path | None, typer.Option(help="Default: FILE.errors.jsonl.")] = None,
    keep_state: Annotated[bool, typer.Option(help="Keep the saved state after success.")] = False,
    restart: Annotated[bool, typer.Option(help="Discard saved state; start over.")] = False,
    quiet: Annotated[bool, typer.Option(help="No progress bars, ours or others'.")] = False,
) -> None:
    """Run a batch JSONL file on this machine (SQLite + in-process worker, no servers).

    Ctrl-C stops it; the same command continues where it stopped (state under
    BATCHWRIGHT_HOME/runs)."""
    from batchwright.runs.command import run_command

    run_command(
        file, output=output, errors=errors, keep_state=keep_state, restart=restart, quiet=quiet
    )


@app.command()
def serve(
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8000,
    workers: Annotated[int, typer.Option(help="API processes.")] = 1,
) -> None:
    """Run the HTTP API (needs BATCHWRIGHT_DATABASE_URL and BATCHWRIGHT_BROKER_URL)."""
    import uvicorn

    from batchwright.api.metrics import start_listener
    from batchwright.config import get_settings

    _check_registry()
    _require_service_urls("serve")
    settings = get_settings()
    start_listener(settings)  # /metrics on a port of its own, when one is set
    uvicorn.run(
        "batchwright.app:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        proxy_headers=True,
        forwarded_allow_ips=settings.forwarded_allow_ips,
        # uvicorn's 5 s closed idle connections just as clients polling every 5 s sent
        # their next request ("Server disconnected without sending a response").
        timeout_keep_alive=int(settings.keep_alive_seconds),
    )


@app.command()
def worker(
    beat: Annotated[
        bool, typer.Option(help="Also run the periodic sweeper (one per deployment).")
    ] = False,
    loglevel: Annotated[str, typer.Option()] = "INFO",
    models: Annotated[
        str | None,
        typer.Option(help="Models to serve, comma-separated (default: all in the registry)."),
    ] = None,
    control_only: Annotated[
        bool, typer.Option(help="Only control work (validate, finalize, sweep); no torch.")
    ] = False,
    control: Annotated[
        bool,
        typer.Option(
            help="Run a control worker beside this one (--no-control: control work is "
            "left to control-only workers)."
        ),
    ] = True,
    supervised_by: Annotated[int | None, typer.Option(hidden=True)] = None,
) -> None:
    """Run a Celery worker: generation in this process (solo pool, each model loaded once),
    control work (validate, finalize, sweep, webhooks) in a control worker it starts and
    supervises beside it, so that control never waits for a generation slice."""
    from batchwright.config import get_settings
    from batchwright.controlplane.routing import worker_queues
    from batchwright.worker import supervisor

    if supervised_by is not None:
        supervisor.bind_to_parent(supervised_by)
    if control_only and not control:
        Console(stderr=True).print("error: --control-only and --no-control exclude each other")
        raise typer.Exit(2)
    # transformers draws a "Loading weights" bar on stderr, which Celery logs as WARNING
    # lines; read before transformers is imported. The worker logs the load itself.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if models is not None:
        os.environ["BATCHWRIGHT_WORKER_MODELS"] = models
    if control_only:
        os.environ["BATCHWRIGHT_WORKER_CONTROL_ONLY"] = "true"
    get_settings.cache_clear()
    _check_registry()
    _require_service_urls("worker")
    if not control_only:
        _check_adapters()
    try:
        queues = worker_queues(control=control_only)
    except ValueError as exc:
        Console(stderr=True).print(f"error: {exc}", highlight=False, soft_wrap=True, markup=False)
        raise typer.Exit(2) from None
    from batchwright.controlplane.celery_app import celery_app

    argv = [
        "worker",
        "-P",
        "solo",
        "-Q",
        ",".join(queues),
        f"--loglevel={loglevel}",
        "--without-gossip",
        "--without-mingle",
    ]
    if supervised_by is not None:
        argv += ["-n", "control@%h"]
        supervisor.tag_logs(celery_app, "control")
    schedule = _beat_schedule()
    children = supervisor.companions(
        control=control and not control_only, beat=beat, loglevel=loglevel, schedule=schedule
    )
    with supervisor.running(children):
        celery_app.worker_main(argv)


def _beat_schedule() -> str:
    """Beat's state file, one per deployment (queue) under BATCHWRIGHT_HOME: one /tmp file
    had every deployment on a host share (and overwrite) one schedule."""
    from batchwright.config import get_settings

    settings = get_settings()
    settings.home.mkdir(parents=True, exist_ok=True)
    return str(settings.home / f"beat-schedule-{settings.queue}")


@app.command()
def beat(
    loglevel: Annotated[str, typer.Option()] = "INFO",
    schedule: Annotated[
        str,
        typer.Option(
            help="Beat's state file (default: BATCHWRIGHT_HOME/beat-schedule-QUEUE).",
            show_default=False,
        ),
    ] = "",
    supervised_by: Annotated[int | None, typer.Option(hidden=True)] = None,
) -> None:
    """Run the periodic sweeper alone (one per deployment; needs the same two URLs)."""
    _require_service_urls("beat")
    from batchwright.controlplane.celery_app import celery_app

    if supervised_by is not None:
        from batchwright.worker.supervisor import bind_to_parent, tag_logs

        bind_to_parent(supervised_by)
        tag_logs(celery_app, "sweeper")

    argv = ["beat", f"--loglevel={loglevel}", "--schedule", schedule or _beat_schedule()]
    celery_app.start(argv)


@db.command("upgrade")
def db_upgrade() -> None:
    """alembic upgrade head on the configured database."""
    from sqlalchemy.engine import make_url

    from batchwright.config import get_settings
    from batchwright.db.migrate import upgrade_head

    upgrade_head()
    settings = get_settings()
    where = make_url(settings.resolved_database_url()).render_as_string(hide_password=True)
    console.print(f"database at head: {where}", markup=False, highlight=False)


def _fail(message: str) -> NoReturn:
    Console(stderr=True, soft_wrap=True).print(f"error: {message}", highlight=False, markup=False)
    raise typer.Exit(1)


@keys.command("create")
def keys_create(
    project: Annotated[str, typer.Option(help="Project name (created if new).")] = "default",
    name: Annotated[str, typer.Option(help="A label for the key.")] = "default",
) -> None:
    """Create an API key; the secret is printed once."""
    from batchwright.auth.service import create_key
    from batchwright.db.session import session_scope

    # Database errors: one line, from the command group (client.ClientGroup).
    with session_scope() as session:
        key, secret = create_key(session, project, name)
        key_id = key.id
    Console(stderr=True).print(f"key id: {key_id}", highlight=False, markup=False)
    sys.stdout.write(secret + "\n")


@keys.command("revoke")
def keys_revoke(key_id: str) -> None:
    """Revoke an API key by its id (key_…, from `batchwright keys list`)."""
    from batchwright.auth.service import revoke_key
    from batchwright.db.session import session_scope

    if not key_id.startswith("key_"):
        # Most likely the secret itself: never echo it back to the terminal (or its logs).
        _fail("that is not a key id: pass the key_… id that `batchwright keys list` shows")
    try:
        with session_scope() as session:
            revoke_key(session, key_id)
    except NotFound:
        _fail(f"no API key {key_id[:64]} (ids: `batchwright keys list`)")
    console.print(f"revoked {key_id}", markup=False)


if __name__ == "__main__":
    app()
