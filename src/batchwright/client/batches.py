"""`batchwright batches submit|list|get|cancel|watch|download` against a running service."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import openai
import typer
from openai.types import Batch
from rich.text import Text

from batchwright.client.common import (
    ApiKey,
    BaseUrl,
    ClientError,
    Json,
    atomic_write,
    connect,
    fields,
    handled,
    out,
    print_json,
    table,
    when,
)
from batchwright.client.watch import TERMINAL, watch_batch
from batchwright.protocol.endpoints import file_endpoint

app = typer.Typer(help="Batches on a running service (submit, watch, download …).",
                  no_args_is_help=True)  # fmt: skip


def counts(batch: Batch) -> str:
    c = batch.request_counts
    if c is None:
        return "-"
    return f"{c.completed + c.failed}/{c.total} done, {c.failed} failed"


def show(batch: Batch, as_json: bool) -> None:
    if as_json:
        print_json(batch)
        return
    usage = batch.usage
    rows: list[tuple[str, object]] = [
        ("id", batch.id),
        ("status", batch.status),
        ("model", batch.model),
        ("requests", counts(batch)),
        ("input file", batch.input_file_id),
        ("output file", batch.output_file_id),
        ("error file", batch.error_file_id),
        ("created", when(batch.created_at)),
        ("expires", when(batch.expires_at)),
    ]
    if usage is not None:
        rows.append(("tokens", f"{usage.input_tokens} in + {usage.output_tokens} out"))
    if batch.metadata:
        rows.append(("metadata", ", ".join(f"{k}={v}" for k, v in batch.metadata.items())))
    fields(rows)
    if batch.errors and batch.errors.data:
        data = batch.errors.data
        for e in data[:5]:
            out.print(Text.assemble((f"line {e.line}", "red"), f" {e.code}: {e.message}"))
        if len(data) > 5:
            out.print(f"… and {len(data) - 5} more")


def parse_metadata(pairs: list[str]) -> dict[str, str] | None:
    meta: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{pair!r} is not key=value", param_hint="--metadata")
        meta[key] = value
    return meta or None


@app.command("submit")
@handled
def submit(
    path: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True)],
    metadata: Annotated[
        list[str] | None, typer.Option("--metadata", "-m", help="key=value, repeatable.")
    ] = None,
    wait: Annotated[bool, typer.Option(help="Watch it until it ends.")] = False,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
    as_json: Json = False,
) -> None:
    """Upload FILE.jsonl and create a batch from it."""
    meta = parse_metadata(metadata or [])
    client = connect(base_url, api_key)
    with path.open("rb") as fh:
        file = client.files.create(file=(path.name, fh), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id,
        endpoint=file_endpoint(path),  # type: ignore[arg-type]
        completion_window="24h",
        metadata=meta or openai.omit,
    )
    if wait:
        batch = watch_batch(client, batch.id, quiet=as_json)
    show(batch, as_json)
    if wait and batch.status != "completed":
        raise typer.Exit(1)


@app.command("list")
@handled
def list_batches(
    limit: Annotated[int, typer.Option(min=1, max=100, help="At most this many.")] = 20,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
    as_json: Json = False,
) -> None:
    """List batches, newest first."""
    batches = connect(base_url, api_key).batches.list(limit=limit).data
    if as_json:
        print_json(batches)
        return
    table(
        ["id", "status", "model", "requests", "created"],
        [(b.id, b.status, b.model, counts(b), when(b.created_at)) for b in batches],
    )


@app.command("get")
@handled
def get(
    batch_id: str, base_url: BaseUrl = None, api_key: ApiKey = None, as_json: Json = False
) -> None:
    """Show one batch."""
    show(connect(base_url, api_key).batches.retrieve(batch_id), as_json)


@app.command("cancel")
@handled
def cancel(
    batch_id: str, base_url: BaseUrl = None, api_key: ApiKey = None, as_json: Json = False
) -> None:
    """Cancel a batch: lines in flight finish, the rest come back as batch_cancelled."""
    show(connect(base_url, api_key).batches.cancel(batch_id), as_json)


@app.command("watch")
@handled
def watch(
    batch_id: str,
    interval: Annotated[float, typer.Option(min=0.2, help="Seconds between polls.")] = 1.0,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
    as_json: Json = False,
) -> None:
    """Follow a batch live (lines, tokens/s, ETA) until it ends; exit 1 unless completed."""
    batch = watch_batch(connect(base_url, api_key), batch_id, interval=interval, quiet=as_json)
    show(batch, as_json)
    if batch.status != "completed":
        raise typer.Exit(1)


def _save(client: openai.OpenAI, file_id: str | None, path: Path) -> Path | None:
    if file_id is None:
        path.unlink(missing_ok=True)  # an earlier download must not look like this batch's
        return None
    with client.files.with_streaming_response.content(file_id) as response:
        atomic_write(path, response.iter_bytes())
    return path


@app.command("download")
@handled
def download(
    batch_id: str,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Default: BATCH_ID.output.jsonl.")
    ] = None,
    errors: Annotated[
        Path | None, typer.Option("--errors", "-e", help="Default: BATCH_ID.errors.jsonl.")
    ] = None,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Download a finished batch's output and error files."""
    client = connect(base_url, api_key)
    batch = client.batches.retrieve(batch_id)
    if batch.status not in TERMINAL:
        raise ClientError(f"{batch_id} is {batch.status}; its files come when it ends")
    saved = [
        _save(client, batch.output_file_id, output or Path(f"{batch_id}.output.jsonl")),
        _save(client, batch.error_file_id, errors or Path(f"{batch_id}.errors.jsonl")),
    ]
    for label, path in zip(("output", "errors"), saved, strict=True):
        out.print(f"{label}: {path or '-'}")
