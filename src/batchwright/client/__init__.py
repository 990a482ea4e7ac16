"""The CLI client for a running service, on the official openai SDK: `batchwright files`,
`batches`, `models`, `complete` (base URL and key from OPENAI_BASE_URL / OPENAI_API_KEY or
flags), plus `keys list` and `--version`.

The SDK takes about a second to import and `batchwright run` never uses it: the client's
command groups are imported when one of them runs (or help lists them), not with the CLI."""

from __future__ import annotations

import importlib
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

# Command group -> the module whose `app` holds it.
LAZY_GROUPS = {
    "files": "batchwright.client.files",
    "batches": "batchwright.client.batches",
    "models": "batchwright.client.models",
}


class ClientGroup(TyperGroup):
    """The `batchwright` group: its own commands, and the client's groups on first use."""

    # Contexts and commands are click's, or in recent typer its own copy of click.
    def list_commands(self, ctx: Any) -> list[str]:
        return [*super().list_commands(ctx), *(n for n in LAZY_GROUPS if n not in self.commands)]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name in LAZY_GROUPS and cmd_name not in self.commands:
            module = importlib.import_module(LAZY_GROUPS[cmd_name])
            group = typer.main.get_group(module.app)
            group.name = cmd_name
            self.commands[cmd_name] = group
        return super().get_command(ctx, cmd_name)

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as exc:
            # The operator commands (db, keys, projects, webhooks) on a database that is
            # missing, down or not migrated: one line naming it and the fix.
            sa_exc = sys.modules.get("sqlalchemy.exc")
            if sa_exc is None or not isinstance(exc, sa_exc.SQLAlchemyError):
                raise
            from rich.console import Console

            from batchwright.config import get_settings
            from batchwright.db.problems import explain

            line = explain(exc, get_settings().resolved_database_url())
            Console(stderr=True, soft_wrap=True).print(
                f"error: {line}", highlight=False, markup=False
            )
            raise typer.Exit(1) from None


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


def plain_help() -> None:
    """Recent typer prints every flag's type as `<bool>` and a required argument as `{file}`
    in help pages, which read as things to type: flags get no type, arguments read FILE
    (and [FILE] when optional). A typer without these methods keeps its own help."""
    from typer import core

    typed = getattr(core.TyperOption, "display_type_rich", None)
    if typed is not None:

        def display_type_rich(self: Any, ctx: Any) -> str | None:
            return None if self.is_flag else typed(self, ctx)

        core.TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]
    if hasattr(core.TyperArgument, "_usage_display_name"):

        def usage_name(self: Any) -> str:
            name = str(self.metavar or self.name or "").upper()
            name = name if self.required else f"[{name}]"
            return name + ("..." if self.nargs != 1 else "")

        core.TyperArgument._usage_display_name = usage_name  # type: ignore[method-assign]


def register(app: typer.Typer, keys: typer.Typer) -> None:
    """Add the client's eager parts to the `batchwright` app (made with cls=ClientGroup,
    which adds the command groups on first use). `complete` is light: the SDK is imported
    when it runs."""
    from batchwright.client.complete import complete
    from batchwright.client.keys import keys_list

    plain_help()
    app.callback()(_main)
    app.command("complete")(complete)
    keys.command("list")(keys_list)
