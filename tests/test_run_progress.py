"""`batchwright run`'s progress line (issue 36, item 4): rates from the first generated token,
no stale "building", the load counter from zero after a build, and a Ctrl-C during the
kernel build that says only that the run stopped."""

from __future__ import annotations

import os
import pty
import re
import select
import shutil
import sys
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console

from batchwright.engine.requests.types import GenResult
from batchwright.runs.progress import LiveCounts, RunView

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "completions.jsonl"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _view(clock: Clock) -> tuple[RunView, StringIO]:
    out = StringIO()
    return RunView(Console(file=out, width=200), enabled=False, clock=clock), out


def _result(tokens: int) -> GenResult:
    return GenResult(key="x", status_code=200, completion_tokens=tokens)


def test_load_counter_restarts_after_a_build_and_building_is_gone() -> None:
    clock = Clock()
    view, out = _view(clock)
    with view.doing("loading demo"):
        clock.now += 20  # importing torch
        assert view.describe() == "loading demo · 20 s"
        with view.building("the CPU kernels") as outcome:
            clock.now += 38
            assert view.describe() == "building the CPU kernels · 38 s"
            outcome.built = True
        assert "built the CPU kernels in 38 s" in out.getvalue()
        assert view.describe() == "loading demo · 0 s"
        clock.now += 3
        assert view.describe() == "loading demo · 3 s"
    view.update("in_progress", 8, LiveCounts(clock))
    assert view.describe() == "generating"


def test_a_build_that_failed_or_was_stopped() -> None:
    clock = Clock()
    view, out = _view(clock)
    with view.building("the CPU kernels") as outcome:
        clock.now += 2
        outcome.built = False
    assert "could not build the CPU kernels (2 s); going on without it" in out.getvalue()
    with view.building("the demo model") as outcome:
        outcome.stopped = True
    assert "built the demo model" not in out.getvalue()


def test_rates_count_from_the_first_generated_token() -> None:
    clock = Clock()
    view, _ = _view(clock)
    counts = LiveCounts(clock)
    clock.now += 60  # loading and building: nothing generated, no rate, no ETA
    view.update("in_progress", 8, counts)
    assert view.progress.tasks[0].fields["rate"] == "-"
    assert view.progress.tasks[0].fields["eta"] == "--:--"
    counts.generating()
    clock.now += 4
    for _ in range(2):
        counts.add(_result(40))
    view.update("in_progress", 8, counts)
    fields = view.progress.tasks[0].fields
    # 80 tokens in the 4 s since the first token (not in the 64 s since the start);
    # 2 lines in 4 s leave 6 lines for 12 s.
    assert fields["rate"] == "20" and fields["eta"] == "0:12"
    # Later passes leave the origin where it was.
    counts.generating()
    assert counts.first_token == (1060.0, 0, 0)


def _drive(argv: list[str], env: dict[str, str], interrupt_on: str) -> tuple[str, int]:
    """Run argv on a terminal of its own (Rich draws the live line only on one) and type
    Ctrl-C once `interrupt_on` appears; return the screen's text and the exit code."""
    pid, fd = pty.fork()
    if pid == 0:
        os.execve(argv[0], argv, env)
    chunks: list[bytes] = []
    sent = False
    while True:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            continue
        try:
            data = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
        if not sent and interrupt_on.encode() in b"".join(chunks):
            os.write(fd, b"\x03")  # as the keyboard does: SIGINT to the whole group
            sent = True
    _, status = os.waitpid(pid, 0)
    raw = b"".join(chunks).decode(errors="replace")
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw), os.waitstatus_to_exitcode(status)


@pytest.mark.timeout(900)
def test_cold_run_says_what_it_builds_and_stops_cleanly_in_the_kernel_build(
    tmp_path: Path,
) -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the kernel is never built here")
    src = tmp_path / "in.jsonl"
    src.write_bytes(EXAMPLE.read_bytes())
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWRIGHT_")}
    # Cold: no demo model and no kernel yet.
    env |= {
        "BATCHWRIGHT_HOME": str(tmp_path / "home"),
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "kernels"),
        "COLUMNS": "200",
    }
    argv = [sys.executable, "-m", "batchwright.cli", "run", str(src)]
    screen, code = _drive(argv, env, interrupt_on="building the CPU kernels · ")
    frames = [f.strip() for f in re.split(r"[\r\n]+", screen) if f.strip()]

    built = next(i for i, f in enumerate(frames) if f.startswith("built the demo model in "))
    kernel = next(i for i, f in enumerate(frames) if f.startswith("building the CPU kernels"))
    # Once the model is built the line says so at once: no frame still "building" it, and
    # loading counts again from zero.
    between = frames[built + 1 : kernel]
    assert not [f for f in between if "building the demo model" in f], between
    loading = [f for f in between if "loading demo · " in f]
    assert loading and "loading demo · 0 s" in loading[0], between

    # Ctrl-C in the kernel build: the run says it stopped, and nothing about the build.
    assert code == 130, screen[-2000:]
    assert "interrupted at 0 of 8 lines; run the same command again to continue" in screen
    assert "built the CPU kernels" not in screen
    assert "could not build" not in screen
    assert "unavailable" not in screen, screen[-2000:]
