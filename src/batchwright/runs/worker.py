"""The in-process worker of `batchwright run`: the inline queue drained in a thread with
the task functions Celery calls in the service (control.py, worker/generation/runner.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from sqlalchemy import func, select

from batchwright import control
from batchwright.config import get_settings
from batchwright.controlplane.dispatch import FINALIZE, PROCESS, VALIDATE, InlineDispatcher
from batchwright.db.models import BatchRequest
from batchwright.db.session import session_scope
from batchwright.registry import ModelSpec
from batchwright.runs.builds import first_use_builds
from batchwright.runs.interrupt import Interrupt
from batchwright.runs.progress import LiveCounts, RunView
from batchwright.worker.generation import runner
from batchwright.worker.generation.engine_host import EngineHost, HostObserver

if TYPE_CHECKING:
    from batchwright.engine.engine import Engine
    from batchwright.engine.requests.types import GenResult


class Watching(HostObserver):
    """What the run sees of the engine, through its host: results are counted for the
    progress line (its rates from the first forward pass), and after an interrupt the
    engine's thread parks at its next step (runs/interrupt.py)."""

    def __init__(self, counts: LiveCounts, interrupt: Interrupt) -> None:
        self.counts, self.interrupt = counts, interrupt

    def step(self) -> None:
        self.interrupt.park()

    def forward(self, seconds: float, prompt_tokens: int) -> None:
        self.counts.generating()

    def finished(self, result: GenResult) -> None:
        self.counts.add(result)


class InlineWorker:
    """The in-process worker: drains the inline queue with the service's task functions."""

    def __init__(
        self,
        dispatcher: InlineDispatcher,
        counts: LiveCounts,
        interrupt: Interrupt,
        view: RunView,
    ) -> None:
        self.dispatcher, self.counts, self.interrupt = dispatcher, counts, interrupt
        self.view = view
        self.failures: list[BaseException] = []
        self.watching = Watching(counts, interrupt)
        self.hosts: list[EngineHost] = []  # those watched

    def engine(self, spec: ModelSpec) -> Engine:
        # The progress line says so while torch and the model load (seconds, every run).
        with self.view.doing(f"loading {spec.name}"):
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # ours says it all
            # Its advisories too (a masked-LM's "add is_decoder=True" on the way to a refusal):
            # the run's own line says what went wrong, and the loader refuses what matters.
            hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
            for build in [] if runner.loaded(spec.name) else first_use_builds(spec):
                if self.interrupt.requested.is_set():
                    break  # Ctrl-C: the next build would only be cut short too
                with self.view.building(build.what) as outcome:
                    outcome.built = build.run()
                    outcome.stopped = self.interrupt.requested.is_set()
            engine = runner.engine_for(spec)
        # The engine runs in its host (the one runner.process attaches the lease to, kept
        # for the next slice), which this run watches while it lasts.
        with runner.host_for(spec.name, engine, get_settings()) as host:
            if host not in self.hosts:
                host.observe(self.watching)
                self.hosts.append(host)
        return engine

    def validate(self, batch_id: str) -> None:
        control.validate_batch(batch_id)
        # Lines rejected by validation count as failed before any generation starts.
        self.counts.rebase(*finished(batch_id))

    def run(self) -> None:
        try:
            self._drain()
        except BaseException as exc:  # surfaced by run_file in the main thread
            self.failures.append(exc)
        finally:
            for host in self.hosts:
                host.unobserve(self.watching)

    def _drain(self) -> None:
        tasks: dict[str, Callable[..., object]] = {
            VALIDATE: self.validate,
            PROCESS: functools.partial(
                runner.process, engine_provider=self.engine, on_cancel=control.finalize_batch
            ),
            FINALIZE: control.finalize_batch,
        }
        queue = self.dispatcher.queue
        while queue:
            name, args = queue.popleft()
            tasks[name](*args)
        # Whatever a crash or a lost wake-up left behind, the sweeper's pass picks up.
        control.sweep()
        while queue:
            name, args = queue.popleft()
            tasks[name](*args)


def finished(batch_id: str) -> tuple[int, int]:
    """(lines done, lines failed) as the database holds them."""
    with session_scope() as session:
        states = dict(
            session.execute(
                select(BatchRequest.state, func.count())
                .where(BatchRequest.batch_id == batch_id)
                .group_by(BatchRequest.state)
            ).all()
        )
    failed = int(states.get("failed", 0))
    return int(states.get("succeeded", 0)) + failed, failed
