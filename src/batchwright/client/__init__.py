"""The CLI client for a running service, on the official openai SDK: `batchwright files`,
`batches`, `models`, `complete` (base URL and key from OPENAI_BASE_URL / OPENAI_API_KEY or flags),
plus `keys list` and `--version`."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

import typer


def _version(show: bool) -> None:
    if show:
        try:
            typer.echo(f"batchwright {version('batchwright')}")
        except PackageNotFoundError:
            typer.echo("batchwright (not installed: running from source)")
        raise typer.Exit()


def _main(
    _version_flag: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Self-hosted, OpenAI-compatible batch inference."""


def register(app: typer.Typer, keys: typer.Typer) -> None:
    """Add the client's commands to the `batchwright` app."""
    from batchwright.client import batches, files, models
    from batchwright.client.complete import complete
    from batchwright.client.keys import keys_list

    app.callback()(_main)
    app.add_typer(files.app, name="files")
    app.add_typer(batches.app, name="batches")
    app.add_typer(models.app, name="models")
    app.command("complete")(complete)
    keys.command("list")(keys_list)
