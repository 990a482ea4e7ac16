"""The end of `batchwright run`: the batch in a small table and failed lines grouped by
error code, each with a count and its first few messages with line numbers."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from sqlalchemy import select

from batchwright.db.models import BatchRequest
from batchwright.db.session import session_scope
from batchwright.protocol.batches import BatchObject

SHOWN_CODES = 6
SHOWN_MESSAGES = 3


@dataclass
class CodeGroup:
    count: int = 0
    # (line number, or None for an error of the whole file, message)
    first: list[tuple[int | None, str]] = field(default_factory=list)


def group_failures(failures: Iterable[tuple[int | None, str, str]]) -> dict[str, CodeGroup]:
    """(line, code, message) -> groups by code, keeping the first few messages of each."""
    groups: dict[str, CodeGroup] = {}
    for line, code, message in failures:
        group = groups.setdefault(code, CodeGroup())
        group.count += 1
        if len(group.first) < SHOWN_MESSAGES:
            group.first.append((line, message))
    return groups


def line_failures(batch_id: str) -> Iterable[tuple[int, str, str]]:
    """Failed lines of a batch from its rows, streamed in input order."""
    query = (
        select(BatchRequest.line_no, BatchRequest.error, BatchRequest.state)
        .where(BatchRequest.batch_id == batch_id, BatchRequest.state != "succeeded")
        .order_by(BatchRequest.line_no)
        .execution_options(yield_per=1000)
    )
    with session_scope() as session:
        for line, error, state in session.execute(query):
            err = orjson.loads(error) if error else {}
            err = err.get("error", err) if isinstance(err, dict) else {}
            yield line, str(err.get("code") or err.get("type") or state), str(err.get("message"))


def print_groups(console: Console, title: str, groups: dict[str, CodeGroup]) -> None:
    if not groups:
        return
    console.print(f"[bold red]{title}[/bold red]")
    ranked = sorted(groups.items(), key=lambda kv: (-kv[1].count, kv[0]))
    for code, group in ranked[:SHOWN_CODES]:
        if all(line is None for line, _ in group.first):
            # An error of the whole file (empty, too many lines): its message says it all.
            console.print(f"  [red]{escape(code)}[/red]", highlight=False)
        else:
            lines = "line" if group.count == 1 else "lines"
            console.print(f"  [red]{escape(code)}[/red]: {group.count} {lines}", highlight=False)
        for line, message in group.first:
            if line is None:
                console.print(f"    {escape(message)}", highlight=False)
                continue
            # Validation messages already start with "Line N: ".
            message = message.removeprefix(f"Line {line}: ")
            console.print(f"    line {line}: {escape(message)}", highlight=False)
        if group.count > len(group.first):
            console.print(f"    … and {group.count - len(group.first)} more", highlight=False)
    if len(ranked) > SHOWN_CODES:
        console.print(f"  … and {len(ranked) - SHOWN_CODES} more error codes", highlight=False)


def print_report(
    console: Console, batch: BatchObject, output: Path | None, errors: Path | None
) -> None:
    table = Table(title=f"{batch.id} — {batch.status}", show_header=False)
    counts, usage = batch.request_counts, batch.usage
    table.add_row("model", escape(batch.model or "-"))
    table.add_row(
        "requests", f"{counts.total} total, {counts.completed} completed, {counts.failed} failed"
    )
    table.add_row(
        "usage",
        f"{usage.input_tokens} input + {usage.output_tokens} output = {usage.total_tokens} tokens",
    )
    table.add_row("output", escape(str(output or "-")))
    table.add_row("errors", escape(str(errors or "-")))
    console.print(table)
    if batch.errors and batch.errors.data:
        # Lines count from 1: line 0 (or none) is an error of the whole file.
        data = batch.errors.data
        file_errors = ((e.line or None, e.code or "error", e.message or "") for e in data)
        print_groups(console, "the file cannot run:", group_failures(file_errors))
    elif counts.failed:
        print_groups(
            console, "failed lines by error code:", group_failures(line_failures(batch.id))
        )
