"""What a person sees while `batchwright run` works: lines done of total, failed lines,
generated tokens per second (embedded tokens for an embeddings file) and the time left,
updated as each line finishes.

Results are counted as the engine yields them (the database only sees them a flush later,
in steps of up to 32 lines), on top of what was already done when generation started.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from batchwright.engine.types import GenRequest, GenResult

# Rates are measured over this trailing window, so the ETA follows the current pace.
WINDOW_SECONDS = 20.0


class LiveCounts:
    """Lines finished and tokens generated, counted in the worker thread as results appear."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.base_done = self.base_failed = 0
        self.done = self.failed = self.tokens = 0

    def rebase(self, done: int, failed: int) -> None:
        """What the database holds before any result of this process is counted."""
        with self._lock:
            self.base_done, self.base_failed = done, failed
            self.done = self.failed = 0

    def add(self, result: GenResult) -> None:
        with self._lock:
            self.done += 1
            if result.status_code != 200:
                self.failed += 1
            # An embeddings line generates nothing: its tokens/s are the tokens embedded.
            body = result.completion
            embedded = body is not None and body.get("object") == "list"
            self.tokens += result.prompt_tokens if embedded else result.completion_tokens

    def snapshot(self) -> tuple[int, int, int]:
        with self._lock:
            return self.base_done + self.done, self.base_failed + self.failed, self.tokens


def counting(
    run: Callable[..., Iterator[GenResult]], counts: LiveCounts
) -> Callable[..., Iterator[GenResult]]:
    """Wrap an engine's run so every result it yields is counted."""

    def counted(requests: Iterable[GenRequest], *args: Any, **kwargs: Any) -> Iterator[GenResult]:
        for result in run(requests, *args, **kwargs):
            counts.add(result)
            yield result

    return counted


class _Rates:
    def __init__(self) -> None:
        self.samples: deque[tuple[float, int, int]] = deque()

    def add(self, done: int, tokens: int) -> tuple[float, float]:
        now = time.monotonic()
        self.samples.append((now, done, tokens))
        while now - self.samples[0][0] > WINDOW_SECONDS:
            self.samples.popleft()
        t0, d0, k0 = self.samples[0]
        span = now - t0
        if span < 1.0:
            return 0.0, 0.0
        return (done - d0) / span, (tokens - k0) / span


def eta_text(remaining: int, per_second: float) -> str:
    if per_second <= 0:
        return "--:--"
    seconds = int(remaining / per_second)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class RunView:
    """The progress line. Disabled, it draws nothing and costs nothing."""

    def __init__(self, console: Console, *, enabled: bool) -> None:
        self.console = console
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("lines · [red]{task.fields[failed]} failed[/red]"),
            TextColumn("· {task.fields[rate]} tok/s · ETA {task.fields[eta]}"),
            TimeElapsedColumn(),
            console=console,
            disable=not enabled,
            refresh_per_second=10,
        )
        self.task = self.progress.add_task("starting", total=None, failed=0, rate="-", eta="--:--")
        self.rates = _Rates()
        self._doing: tuple[str, float] | None = None  # what runs before generation, since when

    def __enter__(self) -> RunView:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def note(self, message: str) -> None:
        """A line printed above the progress line (or alone when it is disabled)."""
        self.console.print(message, highlight=False)

    @contextmanager
    def doing(self, what: str) -> Iterator[float]:
        """`what` (and its seconds so far) on the progress line while it runs; yields when
        it started."""
        started, before = time.monotonic(), self._doing
        self._doing = (what, started)
        try:
            yield started
        finally:
            self._doing = before

    @contextmanager
    def building(self, what: str) -> Iterator[None]:
        """A first-use build: said when it starts, its seconds counted on the progress line
        while it runs (no estimate: it takes seconds to minutes, by machine), and said
        again with the time it took."""
        self.note(f"building {what} (first use only; later runs reuse it)")
        with self.doing(f"building {what}") as started:
            yield
        self.note(f"built {what} in {time.monotonic() - started:.0f} s")

    def update(self, status: str, total: int | None, counts: LiveCounts) -> None:
        done, failed, tokens = counts.snapshot()
        per_line, per_token = self.rates.add(done, tokens)
        described = {"in_progress": "generating", "validating": "checking lines"}
        description = described.get(status, status)
        if (doing := self._doing) is not None:
            description = f"{doing[0]} · {time.monotonic() - doing[1]:.0f} s"
        self.progress.update(
            self.task,
            description=description,
            total=total or None,
            completed=done,
            failed=failed,
            rate=f"{per_token:,.0f}" if per_token else "-",
            eta=eta_text((total or 0) - done, per_line),
        )
