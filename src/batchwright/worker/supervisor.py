"""A worker's companion processes: its control worker and, with `--beat`, the sweeper.

A generation worker runs Celery's solo pool: a `process` task holds it for a whole work
slice (`WORK_SLICE_SECONDS`), and a validate, finalize, sweep or webhook delivery received
meanwhile waited for the slice to end: a 20-line batch sat a minute behind another team's
big one (issue 22). So `batchwright worker` consumes only its models' queues and starts a
control-only worker beside itself (no torch; the same code as `worker --control-only`),
and with `--beat` the sweeper, as child processes it supervises:

- a child that exits while the worker runs is started again, after a pause that grows
  while it keeps dying (1 s doubling to 30 s, back to 1 s once it has run a minute);
- the worker's shutdown is theirs: a warm shutdown (SIGTERM) is passed on as SIGTERM, so
  each stops taking work, finishes what it holds and exits, and the worker waits for them;
- a worker that dies outright (SIGKILL, the OOM killer) takes them with it: each asks the
  kernel for SIGKILL when its parent dies (`bind_to_parent`), as a host's death would;
- they are in the worker's process group, so a signal to the group (a terminal's Ctrl-C,
  the fault tests' SIGSTOP and SIGKILL) reaches them too.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Restart pauses: a child that keeps failing (a broker that refuses it, say) is not spun.
FIRST_PAUSE, MAX_PAUSE, HEALTHY_AFTER = 1.0, 30.0, 60.0
# How long a stopping worker waits for its children before killing them.
STOP_TIMEOUT = 300.0


@dataclass
class Child:
    """One supervised process: its command line and the environment it adds."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    pause: float = FIRST_PAUSE
    due: float = 0.0  # when to start it again, once it died

    def start(self) -> None:
        self.popen = subprocess.Popen(self.argv, env={**os.environ, **self.env})
        self.started = time.monotonic()
        log.info("started %s (pid %d)", self.name, self.popen.pid)


def cli_child(name: str, args: Sequence[str], **env: str) -> Child:
    """A `batchwright ARGS` process bound to this one (`--supervised-by`)."""
    argv = [sys.executable, "-m", "batchwright.cli", *args, "--supervised-by", str(os.getpid())]
    return Child(name, argv, dict(env))


class Supervisor:
    """Starts its children from one thread and keeps them running until `stop`."""

    def __init__(self, children: Sequence[Child]) -> None:
        self.children = list(children)
        self._stopping = threading.Event()
        self._started = threading.Event()
        # A restart and a shutdown passed on do not cross: no child starts after the last.
        self._lock = threading.Lock()
        # The kernel's parent-death signal follows the thread that forked a child, so one
        # long-lived thread starts them all (first start and restarts).
        self._thread = threading.Thread(target=self._loop, daemon=True, name="supervisor")

    def start(self) -> None:
        self._thread.start()
        self._started.wait()

    def _loop(self) -> None:
        for child in self.children:
            child.start()
        self._started.set()
        while not self._stopping.wait(0.5):
            for child in self.children:
                try:
                    self._watch(child)
                except Exception as exc:  # a failed start: tried again after the pause
                    log.warning("%s: %r", child.name, exc)
                    child.due = time.monotonic() + child.pause
        # This thread must outlive its children (their parent-death signal is its exit).
        for child in self.children:
            if child.popen is not None:
                child.popen.wait()

    def _watch(self, child: Child) -> None:
        now = time.monotonic()
        if child.popen is not None:
            code = child.popen.poll()
            if code is None:
                if now - child.started > HEALTHY_AFTER:
                    child.pause = FIRST_PAUSE
                return
            if self._stopping.is_set():
                return
            pause = child.pause
            log.warning("%s exited with %s; starting it again in %.0f s", child.name, code, pause)
            child.popen, child.due = None, now + pause
            child.pause = min(pause * 2, MAX_PAUSE)
        if now >= child.due:
            with self._lock:
                if not self._stopping.is_set():
                    child.start()

    def pass_on(self, sig: int) -> None:
        """A shutdown of the worker's, passed on to its children; no restarts from now on."""
        with self._lock:
            self._stopping.set()
            for child in self.children:
                if child.popen is not None and child.popen.poll() is None:
                    with suppress(ProcessLookupError):
                        child.popen.send_signal(sig)

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM (unless a shutdown was passed on already) and wait; SIGKILL past `timeout`."""
        if not self._stopping.is_set():
            self.pass_on(signal.SIGTERM)
        end = time.monotonic() + timeout
        for child in self.children:
            if child.popen is None:
                continue
            try:
                child.popen.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s; killing it", child.name, timeout)
                child.popen.kill()
                child.popen.wait()
        self._thread.join(timeout=5)


def companions(*, control: bool, beat: bool, loglevel: str, schedule: str) -> list[Child]:
    """What a worker starts beside itself: a control worker unless told `--no-control`,
    the sweeper with `--beat`."""
    children = []
    if control:
        # Its own metrics endpoint would take the worker's port; it serves none.
        argv = ["worker", "--control-only", "--loglevel", loglevel]
        children.append(cli_child("control worker", argv, BATCHWRIGHT_WORKER_METRICS_PORT="0"))
    if beat:
        argv = ["beat", "--loglevel", loglevel, "--schedule", schedule]
        children.append(cli_child("sweeper", argv))
    return children


@contextmanager
def running(children: Sequence[Child]) -> Iterator[Supervisor]:
    """The children run while the block does (a Celery worker: its shutdown is passed on
    to them as it begins) and are stopped, and waited for, after it."""
    from celery.signals import worker_shutting_down

    supervisor = Supervisor(children)

    def pass_on(how: str = "Warm", **_: Any) -> None:
        supervisor.pass_on(signal.SIGQUIT if how == "Cold" else signal.SIGTERM)

    if children:
        worker_shutting_down.connect(pass_on, weak=False)
        supervisor.start()
    try:
        yield supervisor
    finally:
        if children:
            supervisor.stop()
            worker_shutting_down.disconnect(pass_on)


def tag_logs(app: Any, name: str) -> None:
    """A child's log lines name it (they share the worker's output)."""
    head = f"[%(asctime)s: %(levelname)s/{name}]"
    app.conf.worker_log_format = f"{head} %(message)s"
    app.conf.worker_task_log_format = f"{head} %(task_name)s[%(task_id)s]: %(message)s"


def bind_to_parent(parent: int) -> None:
    """In a child: die when `parent` does, whichever way it dies.

    Linux delivers SIGKILL on the parent's death (prctl); elsewhere a thread watches for
    the parent to change. A parent gone before the binding ends this process now."""
    bound = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            bound = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
        except (OSError, AttributeError):
            bound = False
    if os.getppid() != parent:
        os._exit(1)
    if not bound:

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, daemon=True, name="parent-watch").start()
