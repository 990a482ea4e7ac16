"""Ctrl-C and SIGTERM for `batchwright run`.

The first signal stops the run at the next step boundary: the worker thread stops claiming
lines (runner.SHUTDOWN) and the engine's thread (its host's) parks at its next step, before
the step's forward, so rows in flight stay `running` in the state database; the next run
gives them back to the queue. The process then ends with os._exit. That is deliberate:
letting the interpreter finalize while a daemon thread may be inside torch (GIL released)
makes CPython end that thread with pthread_exit, whose forced unwind through torch's C++
frames calls std::terminate ("terminate called without an active exception", exit 134). A
second signal exits at once; SQLite's journal keeps the state consistent either way.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from batchwright.worker.generation import runner

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
# How long the first signal waits for the worker to reach a step boundary.
GRACE_SECONDS = 2.0


class Interrupt:
    def __init__(self) -> None:
        self.requested = threading.Event()
        self.parked = threading.Event()
        self.code = 0
        # Half-written output files to remove when the process ends early.
        self.temp_files: set[Path] = set()
        self._old: dict[int, Any] = {}
        self._on_second: Callable[[], None] | None = None

    def install(self, on_second: Callable[[], None] | None = None) -> None:
        self._on_second = on_second
        for sig in EXIT_CODES:
            self._old[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.requested.is_set():
            if self._on_second is not None:
                self._on_second()
            self.exit_now(self.code)
        self.code = EXIT_CODES.get(signal.Signals(signum), 130)
        self.requested.set()
        runner.SHUTDOWN.set()

    def park(self) -> None:
        """At each engine step (runs/worker.py's observer): after an interrupt, the engine's
        thread waits here for good."""
        if self.requested.is_set():
            self.parked.set()
            threading.Event().wait()

    def wait_for_worker(self, worker: threading.Thread) -> None:
        """Give the worker GRACE_SECONDS to park or to finish what it is doing."""
        deadline = GRACE_SECONDS
        step = 0.05
        while deadline > 0 and worker.is_alive() and not self.parked.is_set():
            worker.join(step)
            deadline -= step

    def exit_now(self, code: int) -> None:
        for path in self.temp_files:
            path.unlink(missing_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
