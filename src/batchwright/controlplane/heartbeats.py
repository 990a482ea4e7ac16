"""Worker heartbeats in Postgres, as the services and the sweeper read them: which workers
are live, what each serves and how busy it is.

A worker process upserts its row every `heartbeat_seconds` (worker/stats.py); it counts as
live for three intervals, so a SIGKILLed worker drops out of /readyz, /v1/models and
wake-ups on its own.
"""

from __future__ import annotations

import json
import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from batchwright.config import Settings, get_settings
from batchwright.db.models import WorkerHeartbeat
from batchwright.db.session import session_scope


def live_after(settings: Settings) -> float:
    return time.time() - 3 * settings.heartbeat_seconds


def live(session: Session, settings: Settings | None = None) -> list[WorkerHeartbeat]:
    settings = settings or get_settings()
    return list(
        session.scalars(
            select(WorkerHeartbeat)
            .where(WorkerHeartbeat.last_seen > live_after(settings))
            .order_by(WorkerHeartbeat.id)
        )
    )


def model_names(beat: WorkerHeartbeat) -> list[str]:
    return [m for m in beat.models.split(",") if m]


def capacity(session: Session, settings: Settings | None = None) -> dict[str, int]:
    """Live workers per model."""
    counts: dict[str, int] = {}
    for beat in live(session, settings):
        for model in model_names(beat):
            counts[model] = counts.get(model, 0) + 1
    return counts


def model_capacity(settings: Settings) -> dict[str, int]:
    """Live workers for every model name (0 where none): an adapter's are its base's."""
    from batchwright.catalog import registry

    with session_scope() as session:
        counts = capacity(session, settings)
        reg = registry(session, settings)
    return {name: counts.get(reg.base_of(name), 0) for name in reg.all_names}


def adapter_holders(session: Session, settings: Settings | None = None) -> dict[str, int]:
    """Live workers holding each LoRA adapter (read, or in a device slot)."""
    counts: dict[str, int] = {}
    for beat in live(session, settings):
        for name in (beat.adapters or "").split(","):
            if name:
                counts[name] = counts.get(name, 0) + 1
    return counts


def refusals(session: Session, settings: Settings | None = None) -> dict[str, str]:
    """Why live workers refused a model at load, for models no live worker serves."""
    beats = live(session, settings)
    served = {m for beat in beats for m in model_names(beat)}
    out: dict[str, str] = {}
    for beat in beats:
        try:
            refused = json.loads(beat.refused) if beat.refused else {}
        except ValueError:
            continue
        for model, why in refused.items():
            if model not in served:
                out.setdefault(str(model), str(why))
    return out


def model_refusals(settings: Settings) -> dict[str, str]:
    with session_scope() as session:
        return refusals(session, settings)


def live_workers(session: Session, model: str, *, idle_only: bool = False) -> int:
    return sum(
        1
        for beat in live(session)
        if model in model_names(beat) and not (idle_only and beat.rows_in_flight > 0)
    )
