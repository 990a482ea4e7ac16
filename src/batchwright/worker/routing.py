"""Which queue a message goes to, which queues a worker serves, how many workers to wake.

Generation work (`process`, one model) goes to that model's queue; everything else
(validate, finalize, sweep, deliveries) to the control queue, which any worker serves,
including a control-only worker that never imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.orm import Session

from batchwright.config import Settings, get_settings
from batchwright.registry import Registry, load_registry
from batchwright.worker import heartbeat
from batchwright.worker.dispatch import PROCESS, enqueue


def control_queue(settings: Settings | None = None) -> str:
    return (settings or get_settings()).queue


def model_queue(model: str, settings: Settings | None = None) -> str:
    return f"{control_queue(settings)}.model.{model}"


def queue_for(name: str, args: Sequence[Any], settings: Settings | None = None) -> str:
    if name == PROCESS and args:
        return model_queue(str(args[0]), settings)
    return control_queue(settings)


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


def worker_queues(settings: Settings | None = None) -> list[str]:
    settings = settings or get_settings()
    return [control_queue(settings)] + [model_queue(m, settings) for m in served_models(settings)]


def wake(session: Session, model: str, *, idle_only: bool = False) -> int:
    """Send one `process` per live worker of `model` (after commit), at least one.

    A batch so starts on every worker that can take it at once instead of one worker now
    and the rest at the next sweep. `idle_only` (the sweeper) skips workers busy already.
    """
    count = max(1, heartbeat.live_workers(session, model, idle_only=idle_only))
    for _ in range(count):
        enqueue(session, PROCESS, model)
    return count
