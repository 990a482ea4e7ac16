"""`batchwright files upload|list|get|download|delete` against a running service."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import openai
import typer
from openai.types import FileObject

from batchwright.client.common import (
    ApiKey,
    BaseUrl,
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

app = typer.Typer(help="Files on a running service (upload, list, get, download, delete).",
                  no_args_is_help=True)  # fmt: skip


def show(file: FileObject, as_json: bool) -> None:
    if as_json:
        print_json(file)
        return
    fields(
        [
            ("id", file.id),
            ("filename", file.filename),
            ("purpose", file.purpose),
            ("bytes", file.bytes),
            ("created", when(file.created_at)),
            ("expires", when(file.expires_at)),
        ]
    )


@app.command("upload")
@handled
def upload(
    path: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True)],
    purpose: Annotated[str, typer.Option(help="File purpose.")] = "batch",
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
    as_json: Json = False,
) -> None:
    """Upload a file (a batch input JSONL by default)."""
    with path.open("rb") as fh:
        file = connect(base_url, api_key).files.create(file=(path.name, fh), purpose=purpose)  # type: ignore[arg-type]
    show(file, as_json)


@app.command("list")
@handled
def list_files(
    purpose: Annotated[str | None, typer.Option(help="Only files of this purpose.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=10000, help="At most this many.")] = 100,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
    as_json: Json = False,
) -> None:
    """List files, newest first."""
    client = connect(base_url, api_key)
    page = client.files.list(limit=min(limit, 100), purpose=purpose or openai.omit)
    files: list[FileObject] = []
    for file in page:  # the SDK follows has_more / after
        files.append(file)
        if len(files) >= limit:
            break
    if as_json:
        print_json(files)
        return
    table(
        ["id", "filename", "purpose", "bytes", "created"],
        [(f.id, f.filename, f.purpose, f.bytes, when(f.created_at)) for f in files],
    )


@app.command("get")
@handled
def get(
    file_id: str, base_url: BaseUrl = None, api_key: ApiKey = None, as_json: Json = False
) -> None:
    """Show one file."""
    show(connect(base_url, api_key).files.retrieve(file_id), as_json)


@app.command("download")
@handled
def download(
    file_id: str,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Default: standard output.")
    ] = None,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Download a file's content."""
    client = connect(base_url, api_key)
    with client.files.with_streaming_response.content(file_id) as response:
        if output is None:
            for chunk in response.iter_bytes():
                sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
            return
        atomic_write(output, response.iter_bytes())
    out.print(f"{file_id} -> {output}")


@app.command("delete")
@handled
def delete(
    file_id: str, base_url: BaseUrl = None, api_key: ApiKey = None, as_json: Json = False
) -> None:
    """Delete a file."""
    deleted = connect(base_url, api_key).files.delete(file_id)
    if as_json:
        print_json(deleted)
    else:
        out.print(f"deleted {deleted.id}")
