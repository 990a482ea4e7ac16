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


def _check_registry() -> None:
    """A missing or broken models file: one line naming it and the problem, exit 2."""
    from batchwright.registry import RegistryError, load_registry

    try:
        load_registry()
    except RegistryError as exc:
        Console(stderr=True).print(f"error: {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def _check_adapters() -> None:
    """The registry's LoRA adapters of the models this worker serves, checked against
    their bases as `adapters add` checks one: a malformed one stops the worker in one
    line (a base whose files are not built yet, the demo's, is checked at first use)."""
    from batchwright.adapter_files import AdapterError, check
    from batchwright.registry import load_registry
    from batchwright.worker.routing import served_models

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

    from batchwright.config import get_settings

    _check_registry()
    uvicorn.run(
        "batchwright.app:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        proxy_headers=True,
        forwarded_allow_ips=get_settings().forwarded_allow_ips,
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
    from batchwright.worker import supervisor
    from batchwright.worker.routing import worker_queues

    if supervised_by is not None:
        supervisor.bind_to_parent(supervised_by)
    if control_only and not control:
        Console(stderr=True).print("error: --control-only and --no-control exclude each other")
        raise typer.Exit(2)
    if models is not None:
        os.environ["BATCHWRIGHT_WORKER_MODELS"] = models
    if control_only:
        os.environ["BATCHWRIGHT_WORKER_CONTROL_ONLY"] = "true"
    get_settings.cache_clear()
    _check_registry()
    if not control_only:
        _check_adapters()
    try:
        queues = worker_queues(control=control_only)
    except ValueError as exc:
        Console(stderr=True).print(f"error: {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    from batchwright.worker.celery_app import celery_app

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
    schedule = os.path.join(os.environ.get("TMPDIR", "/tmp"), "bw-beat-schedule")
    children = supervisor.companions(
        control=control and not control_only, beat=beat, loglevel=loglevel, schedule=schedule
    )
    with supervisor.running(children):
        celery_app.worker_main(argv)


@app.command()
def beat(
    loglevel: Annotated[str, typer.Option()] = "INFO",
    schedule: Annotated[str, typer.Option(help="Beat's schedule state file.")] = "",
    supervised_by: Annotated[int | None, typer.Option(hidden=True)] = None,
) -> None:
    """Run the periodic sweeper alone (one per deployment)."""
    from batchwright.worker.celery_app import celery_app

    if supervised_by is not None:
        from batchwright.worker.supervisor import bind_to_parent, tag_logs

        bind_to_parent(supervised_by)
        tag_logs(celery_app, "sweeper")

    argv = ["beat", f"--loglevel={loglevel}"]
    if schedule:
        argv += ["--schedule", schedule]
    celery_app.start(argv)


@db.command("upgrade")
def db_upgrade() -> None:
    """alembic upgrade head on the configured database."""
    from batchwright.db.migrate import upgrade_head

    upgrade_head()
    console.print("database at head")


def _fail(message: str) -> NoReturn:
    Console(stderr=True).print(f"error: {message}", highlight=False)
    raise typer.Exit(1)


def _database_error(exc: Exception) -> NoReturn:
    text = str(exc).lower()
    if "does not exist" in text or "no such table" in text:
        _fail("the database has no tables yet; run `batchwright db upgrade` first.")
    _fail(f"cannot use the database: {str(exc).splitlines()[0][:200]}")


@keys.command("create")
def keys_create(
    project: Annotated[str, typer.Option(help="Project name (created if new).")] = "default",
    name: Annotated[str, typer.Option(help="A label for the key.")] = "default",
) -> None:
    """Create an API key; the secret is printed once."""
    from sqlalchemy.exc import SQLAlchemyError

    from batchwright.auth.service import create_key
    from batchwright.db.session import session_scope

    try:
        with session_scope() as session:
            key, secret = create_key(session, project, name)
            key_id = key.id
    except SQLAlchemyError as exc:
        _database_error(exc)
    Console(stderr=True).print(f"key id: {key_id}", highlight=False)
    sys.stdout.write(secret + "\n")


@keys.command("revoke")
def keys_revoke(key_id: str) -> None:
    """Revoke an API key by id."""
    from sqlalchemy.exc import SQLAlchemyError

    from batchwright.auth.service import revoke_key
    from batchwright.db.session import session_scope

    try:
        with session_scope() as session:
            revoke_key(session, key_id)
    except NotFound as exc:
        _fail(exc.message)
    except SQLAlchemyError as exc:
        _database_error(exc)
    console.print(f"revoked {key_id}")


if __name__ == "__main__":
    app()
