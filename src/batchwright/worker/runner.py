"""Generation: a model loaded once per process, and the `process` task's body (claim,
generate, write results under a lease). Celery's task and the embedded run call it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from batchwright.config import Settings, get_settings
from batchwright.engine.requests.types import ModelRefused
from batchwright.registry import ModelSpec, Registry, load_registry
from batchwright.worker import adapters, heartbeat, lease_process, metrics, pipeline, routing
from batchwright.worker.claims import Lease, is_out_of_memory
from batchwright.worker.dispatch import FINALIZE, PROCESS, get_dispatcher

if TYPE_CHECKING:
    from batchwright.engine.engine import Engine
    from batchwright.worker.engine_host import EngineHost

log = logging.getLogger(__name__)

# Set by SIGTERM handling (Celery's worker_shutting_down): stop claiming, finish what is held.
SHUTDOWN = threading.Event()

_engines: dict[str, Engine] = {}
_loading = threading.Lock()


def loaded(name: str) -> bool:
    """Whether this process has loaded the model already."""
    return name in _engines


def engine_for(spec: ModelSpec) -> Engine:
    """One loaded model per process, loaded on first use (never at import or fork)."""
    with _loading:
        return _load(spec)


def _load(spec: ModelSpec) -> Engine:
    if spec.name not in _engines:
        from batchwright.engine.engine import Engine

        # A worker holds only the models it was started with (--models), each loaded once.
        try:
            if spec.kind == "embed":
                from batchwright.engine.embed.engine import EmbedEngine
                from batchwright.worker.embedding import EmbeddingRunner

                # The same contract (run, max_rows, lm) over the embedding engine.
                _engines[spec.name] = EmbeddingRunner(EmbedEngine.load(spec))  # type: ignore[assignment]
            else:
                _engines[spec.name] = Engine.load(spec)
        except ModelRefused as exc:
            # Known at load, before any line is claimed: the heartbeat stops advertising
            # the model and says why (/v1/models, batch validation).
            with heartbeat.STATS.lock:
                heartbeat.STATS.refused[spec.name] = str(exc)
            raise
        set_cpu_threads(_engines[spec.name], get_settings())
        adapters.attach(_engines[spec.name], spec.name, get_settings())
        metrics.instrument(_engines[spec.name], spec.name)
        metrics.loaded(spec.name)
    return _engines[spec.name]


def set_cpu_threads(engine: Engine, settings: Settings) -> None:
    """Intra-op threads of a model on the CPU: `torch_threads`, or with the lease process
    one fewer than the cores: the lease process and a local Postgres would otherwise
    preempt a thread of the engine's while the others wait for it at the step's barriers
    (figures in docs/scaling.md)."""
    import os

    import torch

    if settings.torch_threads > 0:
        torch.set_num_threads(settings.torch_threads)
    elif lease_process.wanted(settings) and str(engine.lm.device) == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))


def process(
    model: str,
    registry: Registry | None = None,
    engine_provider: Callable[[ModelSpec], Engine] = engine_for,
    on_cancel: Callable[[str], None] | None = None,
    host: EngineHost | None = None,
) -> int:
    """Generate for queued rows of `model` until none are left or the time slice ends.

    `on_cancel(batch_id)` runs, off the generation loop, once lines this lease held of a
    cancelled batch are closed: the caller finalizes it there (control.finalize_batch).
    Without one the batch's finalize is sent as a message. `host`: the model's engine
    loop in this process (worker/engine_host.py), shared with online requests; without
    one the lease runs the engine itself."""
    settings = get_settings()
    spec = (registry or load_registry(settings)).get(model)
    if spec is None or not routing.serves(model, settings) or model in heartbeat.STATS.refused:
        return 0  # a model this process refused at load takes no lines here
    engine = engine_provider(spec)
    landed = 0
    try:
        lease: Lease | lease_process.RemoteLease
        if lease_process.wanted(settings):
            remote = lease_process.RemoteLease(
                model, settings, SHUTDOWN, on_cancel or _finalize, getattr(engine, "prepare", None)
            )
            with remote as lease:
                if host is not None:
                    host.run_lease(lease, lease.put, lease.cancelled)
                else:
                    lease.run(engine)
            landed = lease.landed
        else:
            with Lease(model, settings, SHUTDOWN) as lease:
                lease.cancels.on_batch = on_cancel or _finalize
                landed = pipeline.generate(
                    engine, lease, model, settings, cancelled=lease.cancelled, host=host
                )
    except Exception as exc:
        rows = getattr(engine, "max_rows", 1)
        if not is_out_of_memory(exc) or (rows <= 1 and host is None):
            raise
        # The lease gave the lines back unharmed; decode fewer rows at once and go again
        # (a host has halved its engine's rows already, before its next run).
        if host is None:
            engine.max_rows = max(1, rows // 2)
            log.warning("out of memory with %d rows; retrying with %d", rows, engine.max_rows)
        metrics.OOM_HALVINGS.labels(model).inc()
        get_dispatcher().send(PROCESS, model)
        return landed
    if lease.more_work and not SHUTDOWN.is_set():
        get_dispatcher().send(PROCESS, model)
    return landed


def _finalize(batch_id: str) -> None:
    get_dispatcher().send(FINALIZE, batch_id)
