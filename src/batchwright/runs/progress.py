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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from batchwright.engine.requests.types import GenResult

# Rates are measured over this trailing window, so the ETA follows the current pace.
WINDOW_SECONDS = 20.0


class LiveCounts:
    """Lines finished and tokens generated, counted in the worker thread as results appear."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self.base_done = self.base_failed = 0
        self.done = self.failed = self.tokens = 0
        # (when, lines done, tokens) as the first token of this process was generated: rates
        # count from there, not from the start (loading and first-use builds take seconds to
        # minutes and generate nothing).
        self.first_token: tuple[float, int, int] | None = None

    def rebase(self, done: int, failed: int) -> None:
        """What the database holds before any result of this process is counted."""
        with self._lock:
            self.base_done, self.base_failed = done, failed
            self.done = self.failed = 0

    def generating(self) -> None:
        """The first forward pass has run (the run's observer calls it on every pass)."""
        if self.first_token is None:
            with self._lock:
                if self.first_token is None:
                    self.first_token = (self._clock(), self.base_done + self.done, self.tokens)

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


class _Rates:
    """Lines and tokens per second over a trailing window that never reaches back before
    the first generated token."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, int, int]] = deque()

    def add(
        self, now: float, done: int, tokens: int, origin: tuple[float, int, int] | None
    ) -> tuple[float, float]:
        if origin is None:
            return 0.0, 0.0
        if not self.samples:
            self.samples.append(origin)
        self.samples.append((now, done, tokens))
        while len(self.samples) > 2 and now - self.samples[1][0] >= WINDOW_SECONDS:
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


class _Description(ProgressColumn):
    """What the run is doing, read when the line is drawn (Rich's refresh thread), so a
    finished build never lingers on the line until the next update."""

    def __init__(self, view: RunView) -> None:
        super().__init__()
        self.view = view

    def render(self, task: Task) -> Text:
        return Text(self.view.describe(), style="bold")


@dataclass
class BuildOutcome:
    built: bool = True  # False: it failed (the engine goes on without it, and says why)
    stopped: bool = False  # Ctrl-C came during the build: nothing more is said of it


class RunView:
    """The progress line. Disabled, it draws nothing and costs nothing."""

    def __init__(
        self, console: Console, *, enabled: bool, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.console = console
        self.clock = clock
        self.progress = Progress(
            SpinnerColumn(),
            _Description(self),
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
        self._status = "starting"
        self._doing: tuple[str, float] | None = None  # what runs before generation, since when

    def __enter__(self) -> RunView:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def note(self, message: str) -> None:
        """A line printed above the progress line (or alone when it is disabled)."""
        # Rich draws the line it last rendered below the note: render it anew first.
        self.progress.refresh()
        self.console.print(message, highlight=False, markup=False)

    @contextmanager
    def doing(self, what: str) -> Iterator[None]:
        """`what` (and its seconds so far) on the progress line while it runs."""
        before = self._doing
        self._doing = (what, self.clock())
        try:
            yield
        finally:
            self._doing = before

    @contextmanager
    def building(self, what: str) -> Iterator[BuildOutcome]:
        """A first-use build: said when it starts, its seconds counted on the progress line
        while it runs (no estimate: it takes seconds to minutes, by machine), and said
        again with the time it took. What ran before it (loading) counts again from zero."""
        self.note(f"building {what} (first use only; later runs reuse it)")
        outer, started, outcome = self._doing, self.clock(), BuildOutcome()
        try:
            with self.doing(f"building {what}"):
                yield outcome
        finally:
            if outer is not None:
                self._doing = (outer[0], self.clock())
        if outcome.stopped:
            return
        seconds = self.clock() - started
        if outcome.built:
            self.note(f"built {what} in {seconds:.0f} s")
        else:
            self.note(f"could not build {what} ({seconds:.0f} s); going on without it")

    def describe(self) -> str:
        if (doing := self._doing) is not None:
            return f"{doing[0]} · {self.clock() - doing[1]:.0f} s"
        described = {"in_progress": "generating", "validating": "checking lines"}
        return described.get(self._status, self._status)

    def update(self, status: str, total: int | None, counts: LiveCounts) -> None:
        done, failed, tokens = counts.snapshot()
        per_line, per_token = self.rates.add(self.clock(), done, tokens, counts.first_token)
        self._status = status
        self.progress.update(
            self.task,
            total=total or None,
            completed=done,
            failed=failed,
            rate=f"{per_token:,.0f}" if per_token else "-",
            eta=eta_text((total or 0) - done, per_line),
        )
