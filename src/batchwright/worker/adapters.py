"""LoRA adapters on a worker: which adapter a line names, where the engine finds an
adapter's folder, and the heartbeat's sync that picks up adapters added or removed
(`batchwright adapters`) without a restart."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchwright import catalog
from batchwright.config import Settings
from batchwright.db.session import session_scope
from batchwright.worker.stats import STATS

if TYPE_CHECKING:
    from batchwright.engine.engine import Engine


def adapter_of(body: dict[str, Any], model: str) -> str | None:
    """The LoRA adapter a line of `model`'s workers names: its `model` when not the base."""
    name = body.get("model")
    return name if isinstance(name, str) and name != model else None


def attach(engine: Engine, model: str, settings: Settings) -> None:
    """The engine looks adapters of `model` up in the catalog (registry and database);
    each heartbeat forgets those removed or moved and reports those held."""
    # An embedding model's runner has no adapters (LoRA serves generation models).
    lora = getattr(engine, "lora", None)
    if lora is None:
        return
    store = lora.store

    def lookup(name: str) -> Path | None:
        with session_scope() as session:
            return catalog.adapters_of(session, model, settings).get(name)

    def sync() -> None:
        with session_scope() as session:
            current = catalog.adapters_of(session, model, settings)
        store.sync(current)
        held = set(store.loaded())
        with STATS.lock:
            STATS.adapters = {a for a in STATS.adapters if a not in current} | held

    store.source = lookup
    STATS.before_beat.append(sync)
