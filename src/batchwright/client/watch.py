"""`batches watch`: a live line for one batch, from request_counts and usage, polled."""

from __future__ import annotations

import time

import openai
import typer
from openai.types import Batch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from batchwright.client.common import err
from batchwright.runs.progress import eta_text

TERMINAL = {"completed", "failed", "expired", "cancelled"}
# Rates over this trailing window, so the ETA follows the current pace.
WINDOW_SECONDS = 30.0


def watch_batch(
    client: openai.OpenAI, batch_id: str, *, interval: float = 1.0, quiet: bool = False
) -> Batch:
    """Follow the batch until it ends. Ctrl-C stops the watching, not the batch: it says so
    and exits 130."""
    try:
        if not quiet:
            err.print(f"watching {batch_id} (Ctrl-C stops the watching, not the batch)")
        return _follow(client, batch_id, interval=interval, quiet=quiet)
    except KeyboardInterrupt:
        err.print(
            f"stopped watching {batch_id}; the batch goes on at the server "
            f"(`batchwright batches watch {batch_id}` follows it again, "
            f"`batchwright batches cancel {batch_id}` stops it)"
        )
        raise typer.Exit(130) from None


def _follow(client: openai.OpenAI, batch_id: str, *, interval: float, quiet: bool) -> Batch:
    samples: list[tuple[float, int, int]] = []
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("lines · [red]{task.fields[failed]} failed[/red]"),
        TextColumn("· {task.fields[rate]} tok/s · ETA {task.fields[eta]}"),
        TimeElapsedColumn(),
        console=err,
        disable=quiet,
    ) as progress:
        task = progress.add_task(batch_id, total=None, failed=0, rate="-", eta="--:--")
        while True:
            batch = client.batches.retrieve(batch_id)
            c = batch.request_counts
            done = (c.completed + c.failed) if c else 0
            total = c.total if c else 0
            tokens = batch.usage.output_tokens if batch.usage else 0
            now = time.monotonic()
            samples.append((now, done, tokens))
            samples = [s for s in samples if now - s[0] <= WINDOW_SECONDS]
            span = now - samples[0][0]
            per_line = (done - samples[0][1]) / span if span > 0 else 0.0
            per_token = (tokens - samples[0][2]) / span if span > 0 else 0.0
            progress.update(
                task,
                description=f"{batch_id} {batch.status}",
                total=total or None,
                completed=done,
                failed=c.failed if c else 0,
                rate=f"{per_token:,.0f}" if per_token else "-",
                eta=eta_text(total - done, per_line),
            )
            if batch.status in TERMINAL:
                return batch
            time.sleep(interval)
