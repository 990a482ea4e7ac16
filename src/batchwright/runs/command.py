"""`batchwright run FILE.jsonl`: options, messages and exit codes around embedded.run_file."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from batchwright.runs.interrupt import Interrupt
from batchwright.runs.state import InputProblem, StateBusy

# Third-party progress bars (transformers, huggingface_hub, tqdm) under --quiet.
QUIET_ENV = {
    "TQDM_DISABLE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
}


def run_command(
    file: Path,
    *,
    output: Path | None,
    errors: Path | None,
    keep_state: bool,
    restart: bool,
    quiet: bool,
) -> None:
    if quiet:
        os.environ.update(QUIET_ENV)
    out = Console(highlight=False)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    interrupt = Interrupt()

    # Written straight to the descriptor: the signal may land while the main thread is
    # inside a write to sys.stderr, and a second buffered write from the handler then
    # fails as reentrant (the message was lost in one CI run).
    def stopped_at_once() -> None:
        os.write(2, b"stopped at once; the saved state is kept\n")

    interrupt.install(on_second=stopped_at_once)
    from batchwright.engine.requests.types import ModelRefused
    from batchwright.runs.embedded import RunInterrupted, RunOptions, run_file
    from batchwright.runs.report import print_report

    options = RunOptions(output, errors, keep_state, restart, show_progress=not quiet)
    try:
        result = run_file(file, options, console=err, interrupt=interrupt)
    except RunInterrupted as exc:
        err.print(
            f"interrupted at {exc.done} of {exc.total} lines; "
            "run the same command again to continue",
            markup=False,
        )
        interrupt.exit_now(exc.code)
        raise  # not reached
    except (InputProblem, StateBusy) as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(1) from None
    except ModelRefused as exc:
        # One line, before any state: the architecture and what the engine lacks.
        err.print(f"[red]error:[/red] cannot serve this model: {escape(str(exc))}")
        raise typer.Exit(2) from None
    finally:
        interrupt.uninstall()
    print_report(out, result.batch, result.output_path, result.error_path)
    if result.batch.status != "completed":
        raise typer.Exit(1)
