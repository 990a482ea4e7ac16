"""`batchwright adapters`: LoRA adapters added and removed while workers run.

An adapter is checked against its base model here (the base's weights must be on this
machine: run it where the workers' model files are) and refused in one line if it
cannot be served. Workers serving the base pick the change up within a heartbeat: lines
and online requests naming the adapter are served, and those of a removed one refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

adapters = typer.Typer(
    help="LoRA adapters served by their base model's workers.", no_args_is_help=True
)
console = Console()


def _fail(message: str) -> typer.Exit:
    Console(stderr=True).print(f"error: {message}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


@adapters.command("add")
def adapters_add(
    name: Annotated[str, typer.Argument(help="The model name requests will give.")],
    base: Annotated[str, typer.Option(help="The registry model it adapts.")],
    path: Annotated[Path, typer.Option(help="PEFT adapter folder (on the base's workers).")],
) -> None:
    """Add an adapter: `batchwright adapters add sql-lora --base llama --path /models/sql`."""
    from batchwright.adapter_files import AdapterError
    from batchwright.catalog import add_adapter
    from batchwright.db.session import session_scope
    from batchwright.registry import DEMO_MODEL, RegistryError, load_registry

    try:
        spec = load_registry().get(base)
        if base == DEMO_MODEL and spec is not None:
            from batchwright.engine.loading.demo import ensure_demo_model

            ensure_demo_model(spec.path)  # built on first use: the check reads its weights
        with session_scope() as session:
            row = add_adapter(session, name, base, path)
    except (AdapterError, RegistryError) as exc:
        raise _fail(str(exc)) from None
    console.print(
        f"added {row.name} (base {row.base}, rank {row.rank}, {row.target_modules})",
        highlight=False,
    )


@adapters.command("remove")
def adapters_remove(name: Annotated[str, typer.Argument()]) -> None:
    """Remove an adapter added with `adapters add`; its workers refuse it from then on."""
    from batchwright.adapter_files import AdapterError
    from batchwright.catalog import remove_adapter
    from batchwright.db.session import session_scope

    try:
        with session_scope() as session:
            removed = remove_adapter(session, name)
    except AdapterError as exc:
        raise _fail(str(exc)) from None
    if not removed:
        raise _fail(f"no adapter {name!r} was added here")
    console.print(f"removed {name}", highlight=False)


@adapters.command("list")
def adapters_list() -> None:
    """Adapters of the registry and those added at run time."""
    from batchwright.catalog import list_adapters
    from batchwright.db.session import session_scope

    with session_scope() as session:
        rows = list_adapters(session)
    table = Table("name", "base", "path", "rank", "targets", "source")
    for r in rows:
        table.add_row(r.name, r.base, r.path, str(r.rank or ""), r.target_modules, r.source)
    console.print(table)
