"""Generation: a model loaded once per process, and the `process` task's body (claim,
generate, write results under a lease, the lines run in an engine host). Celery's task and
the embedded run call it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from batchwright.config import Settings, get_settings
from batchwright.controlplane import routing
from batchwright.controlplane.dispatch import FINALIZE, PROCESS, get_dispatcher
from batchwright.engine.requests.types import ModelRefused
from batchwright.registry import ModelSpec, Registry, load_registry
from batchwright.worker import adapters, metrics
from batchwright.worker.generation import engine_host, lease_process
from batchwright.worker.generation.engine_host import EngineHost
from batchwright.worker.lease_child import pipeline
from batchwright.worker.lease_child.claims import Lease, is_out_of_memory
from batchwright.worker.stats import STATS

if TYPE_CHECKING:
    from batchwright.engine.engine import Engine

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
                from batchwright.worker.generation.embedding import EmbeddingRunner

                # The same contract (run, max_rows, lm) over the embedding engine.
                _engines[spec.name] = EmbeddingRunner(EmbedEngine.load(spec))  # type: ignore[assignment]
            else:
                _engines[spec.name] = Engine.load(spec)
        except ModelRefused as exc:
            # Known at load, before any line is claimed: the heartbeat stops advertising
            # the model and says why (/v1/models, batch validation).
            with STATS.lock:
                STATS.refused[spec.name] = str(exc)
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


def host_for(model: str, engine: Any, settings: Settings) -> AbstractContextManager[EngineHost]:
    """The host that runs `engine` in this process when the worker started none for it
    (the embedded run; a task run before or without the worker's hosts): a thread, kept
    for the next lease (engine_host.local)."""
    return engine_host.local(model, engine, orders_ahead=lease_process.wanted(settings))


def process(
    model: str,
    registry: Registry | None = None,
    engine_provider: Callable[[ModelSpec], Engine] = engine_for,
    on_cancel: Callable[[str], None] | None = None,
    host: EngineHost | None = None,
) -> int:
    """Generate for queued rows of `model` until none are left or the time slice ends.

    The lease's lines run in an engine host: `host`, the model's in a worker
    (worker/generation/hosts.py, shared with online requests), or else one of this
    process that runs the engine `engine_provider` gives (host_for). The lease is a
    remote source of lines (a lease process, on Postgres with `lease_process` on) or a
    local one (claim and write threads in this process).

    `on_cancel(batch_id)` runs, off the generation loop, once lines a local lease held of
    a cancelled batch are closed: the caller finalizes it there (control.finalize_batch);
    without one the batch's finalize is sent as a message. A remote lease's child sends
    that message itself."""
    settings = get_settings()
    spec = (registry or load_registry(settings)).get(model)
    if spec is None or not routing.serves(model, settings) or model in STATS.refused:
        return 0  # a model this process refused at load takes no lines here
    if host is not None:
        return _attach(host, model, settings, on_cancel or _finalize)
    with host_for(model, engine_provider(spec), settings) as own:
        return _attach(own, model, settings, on_cancel or _finalize)


def _attach(
    host: EngineHost, model: str, settings: Settings, on_cancel: Callable[[str], None]
) -> int:
    """One lease's lines through `host`; returns how many results landed."""
    landed = 0
    try:
        lease: Lease | lease_process.RemoteLease
        if lease_process.wanted(settings):
            with lease_process.RemoteLease(model, settings, SHUTDOWN, host.prepare) as lease:
                host.run_lease(lease, lease.put, lease.cancelled)
            landed = lease.landed
        else:
            with Lease(model, settings, SHUTDOWN) as lease:
                lease.cancels.on_batch = on_cancel
                landed = generate(host, lease, model, settings)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        # The lease gave the lines back unharmed, and the host halved its engine's rows
        # before its next run (one row left, it fails the lease with another error): go
        # again with fewer rows at once.
        metrics.OOM_HALVINGS.labels(model).inc()
        get_dispatcher().send(PROCESS, model)
        return landed
    if lease.more_work and not SHUTDOWN.is_set():
        get_dispatcher().send(PROCESS, model)
    return landed


def generate(host: EngineHost, lease: Lease, model: str, settings: Settings) -> int:
    """A local lease's lines through `host` (read ahead in a thread, results written by
    another); returns how many results landed."""
    # The engine's window (engine/scheduling/intake.py) hides a claim's latency; lines queued here
    # are ahead of a newcomer's (lease_child/claims.py), so only a few wait here.
    writer = pipeline.ResultWriter(
        lease.token, model, settings.result_queue_size, settings.lease_seconds
    )
    depth = max(1, settings.claim_batch_size // 8)
    # An engine that takes lines as they are (a test's stand-in) has no preparer.
    feed = pipeline.ReadAhead(lease.requests(), model, depth, writer.handed, host.prepare)
    try:
        with writer:
            host.run_lease(feed, writer.put, lease.cancelled)
    finally:
        feed.close()
        if feed.handed > writer.received:
            metrics.released(model, feed.handed - writer.received)
    return writer.landed


def _finalize(batch_id: str) -> None:
    get_dispatcher().send(FINALIZE, batch_id)
