"""A worker process's counters and the heartbeat thread that writes them to its row.

Every Celery worker process (generation or control) upserts its row every
`heartbeat_seconds`; the services read the rows (controlplane/heartbeats.py): a worker
counts as live for three intervals, so a SIGKILLed one drops out on its own.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import delete

from batchwright.config import Settings
from batchwright.db.models import WorkerHeartbeat
from batchwright.db.session import session_scope

log = logging.getLogger(__name__)


@dataclass
class WorkerStats:
    """This process's counters, written by the pipeline, read by the heartbeat."""

    rows_in_flight: int = 0
    lines_completed: int = 0
    tokens: int = 0
    loaded: set[str] = field(default_factory=set)
    refused: dict[str, str] = field(default_factory=dict)  # model -> why, one line
    adapters: set[str] = field(default_factory=set)  # LoRA adapters held (engine/lora/)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Called before each beat (the engines' adapter sync: worker/adapters.py).
    before_beat: list[Callable[[], None]] = field(default_factory=list)

    def add(self, *, in_flight: int = 0, lines: int = 0, tokens: int = 0) -> None:
        with self.lock:
            self.rows_in_flight += in_flight
            self.lines_completed += lines
            self.tokens += tokens


STATS = WorkerStats()


class Heartbeat:
    """The thread that keeps this process's row fresh."""

    def __init__(self, models: list[str], control: bool, settings: Settings) -> None:
        self.settings = settings
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.id = f"{self.host}:{self.pid}"
        self.models = models
        self.control = control
        self.started = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="heartbeat")
        self._last = (time.monotonic(), 0)

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def beat(self) -> None:
        for hook in list(STATS.before_beat):
            try:
                hook()
            except Exception as exc:  # the database is away: the next beat syncs
                log.warning("adapter sync failed: %r", exc)
        now_mono = time.monotonic()
        with STATS.lock:
            in_flight, lines, tokens = STATS.rows_in_flight, STATS.lines_completed, STATS.tokens
            loaded = ",".join(sorted(STATS.loaded))
            refused = dict(STATS.refused)
            adapters = ",".join(sorted(STATS.adapters))
        then, tokens_then = self._last
        rate = (tokens - tokens_then) / max(now_mono - then, 1e-6)
        self._last = (now_mono, tokens)
        with session_scope() as session:
            session.merge(
                WorkerHeartbeat(
                    id=self.id,
                    host=self.host,
                    pid=self.pid,
                    # A model refused at load is not advertised: no work is sent for it.
                    models=",".join(m for m in self.models if m not in refused),
                    loaded=loaded,
                    refused=json.dumps(refused) if refused else "",
                    adapters=adapters,
                    control=self.control,
                    rows_in_flight=in_flight,
                    tokens_per_second=round(rate, 2),
                    lines_completed=lines,
                    started_at=self.started,
                    last_seen=time.time(),
                )
            )

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_seconds):
            try:
                self.beat()
            except Exception as exc:  # the database is away: the next beat retries
                log.warning("heartbeat failed: %r", exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            with session_scope() as session:
                session.execute(delete(WorkerHeartbeat).where(WorkerHeartbeat.id == self.id))
        except Exception as exc:
            log.warning("could not remove heartbeat: %r", exc)
