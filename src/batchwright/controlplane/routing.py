"""Which queues a worker serves and how many workers to wake.

Control-only workers serve the control queue (and never import torch): every `batchwright
worker` starts one beside itself (worker/supervisor.py). A generation worker serves the
queue of each model it serves; dispatch.py says which message goes to which queue.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from batchwright.config import Settings, get_settings
from batchwright.controlplane import heartbeats
from batchwright.controlplane.dispatch import PROCESS, control_queue, enqueue, model_queue
from batchwright.registry import Registry, load_registry


def served_models(settings: Settings | None = None, registry: Registry | None = None) -> list[str]:
    """The models this worker takes work for: BATCHWRIGHT_WORKER_MODELS, else all."""
    settings = settings or get_settings()
    if settings.worker_control_only:
        return []
    registry = registry or load_registry(settings)
    wanted = [m.strip() for m in settings.worker_models.split(",") if m.strip()]
    if not wanted:
        return registry.names
    unknown = [m for m in wanted if registry.get(m) is None]
    if unknown:
        raise ValueError(
            f"--models: {', '.join(unknown)} not in the model registry "
            f"(available: {', '.join(registry.names)})"
        )
    return wanted


def serves(model: str, settings: Settings | None = None) -> bool:
    settings = settings or get_settings()
    if settings.embedded:
        return True
    wanted = [m.strip() for m in settings.worker_models.split(",") if m.strip()]
    return not settings.worker_control_only and (not wanted or model in wanted)


def worker_queues(settings: Settings | None = None, *, control: bool = True) -> list[str]:
    """The queues a worker process consumes: its models' (none for a control-only one),
    and the control queue if `control`. A generation worker leaves control work to a
    control worker (its own companion, worker/supervisor.py, or one of its own): in its
    solo pool a validate waited behind a whole generation slice."""
    settings = settings or get_settings()
    models = [model_queue(m, settings) for m in served_models(settings)]
    return ([control_queue(settings)] if control else []) + models


def wake(session: Session, model: str, *, idle_only: bool = False) -> int:
    """Send one `process` per live worker of `model` (after commit), at least one.

    A batch so starts on every worker that can take it at once instead of one worker now
    and the rest at the next sweep. `idle_only` (the sweeper) skips workers busy already.
    `model` is a queue's model: a LoRA adapter's lines wake its base's workers (callers
    pass the base).
    """
    count = max(1, heartbeats.live_workers(session, model, idle_only=idle_only))
    for _ in range(count):
        enqueue(session, PROCESS, model)
    return count
