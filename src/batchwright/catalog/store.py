"""Adapters added at run time, merged into the registry's view of model names."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import delete, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from batchwright.adapter_files import AdapterError, check
from batchwright.config import Settings, get_settings
from batchwright.db.models import LoraAdapter
from batchwright.db.session import session_scope
from batchwright.registry import AdapterSpec, Registry, load_registry

# How long an API process trusts its view of the adapters (online requests read it per
# request; an adapter added is served by the API within this long).
_CACHE_SECONDS = 2.0


@dataclass(frozen=True)
class AdapterRow:
    name: str
    base: str
    path: str
    source: str  # "registry" | "added"
    rank: int | None = None
    target_modules: str = ""


def _rows(session: Session) -> list[LoraAdapter]:
    return list(session.scalars(select(LoraAdapter).order_by(LoraAdapter.name)))


def registry(session: Session | None = None, settings: Settings | None = None) -> Registry:
    """The registry with the adapters added at run time (a database that cannot be read
    leaves the registry's own)."""
    settings = settings or get_settings()
    base = load_registry(settings)
    try:
        if session is not None:
            rows = _rows(session)
        else:
            with session_scope() as own:
                rows = _rows(own)
                own.expunge_all()
    except SQLAlchemyError:
        return base
    adapters = dict(base.adapters)
    for row in rows:
        if row.name not in adapters and row.name not in base.models and row.base in base.models:
            adapters[row.name] = AdapterSpec(name=row.name, base=row.base, adapter=Path(row.path))
    return Registry(models=base.models, adapters=adapters)


_cache: tuple[float, Registry] | None = None
_cache_lock = threading.Lock()


def cached_registry(settings: Settings | None = None) -> Registry:
    """`registry()`, read at most every couple of seconds (the online path's)."""
    global _cache
    now = time.monotonic()
    with _cache_lock:
        if _cache is not None and now - _cache[0] < _CACHE_SECONDS:
            return _cache[1]
    fresh = registry(None, settings)
    with _cache_lock:
        _cache = (now, fresh)
    return fresh


def family(session: Session, base: str, settings: Settings | None = None) -> list[str]:
    """`base` and every adapter of it: the model names of lines its workers claim."""
    return registry(session, settings).family(base)


def adapters_of(
    session: Session | None, base: str, settings: Settings | None = None
) -> dict[str, Path]:
    """Every adapter of `base` now, by name (what a worker syncs its engine with)."""
    reg = registry(session, settings)
    return {n: a.adapter for n, a in reg.adapters.items() if a.base == base}


def list_adapters(session: Session, settings: Settings | None = None) -> list[AdapterRow]:
    settings = settings or get_settings()
    static = load_registry(settings).adapters
    out = [AdapterRow(a.name, a.base, str(a.adapter), "registry") for a in static.values()]
    for row in _rows(session):
        if row.name not in static:
            out.append(
                AdapterRow(row.name, row.base, row.path, "added", row.rank, row.target_modules)
            )
    return sorted(out, key=lambda r: r.name)


def add_adapter(
    session: Session, name: str, base: str, path: Path, settings: Settings | None = None
) -> AdapterRow:
    """Check the adapter against its base and add it; AdapterError (one line) if not."""
    settings = settings or get_settings()
    reg = registry(session, settings)
    if not name or len(name) > 200 or "," in name or name.strip() != name:
        raise AdapterError(f"adapter name {name!r}: 1-200 characters, no commas or edge spaces")
    if name in reg.models or name in reg.adapters:
        raise AdapterError(f"{name!r} is already a model name here; remove it first")
    spec = reg.get(base)
    if spec is None:
        raise AdapterError(
            f"base {base!r} is not a model of the registry (models: {', '.join(reg.names)})"
        )
    if spec.max_loras == 0:
        raise AdapterError(f"base {base!r} has max_loras 0: its workers serve no adapters")
    base_path = Path(spec.path)
    folder = Path(path).resolve()
    info = check(folder, base_path, spec.max_lora_rank)
    row = LoraAdapter(
        name=name,
        base=base,
        path=str(folder),
        rank=info.rank,
        target_modules=",".join(info.target_names),
        created_at=int(time.time()),
    )
    session.add(row)
    session.flush()
    return AdapterRow(name, base, str(folder), "added", info.rank, row.target_modules)


def remove_adapter(session: Session, name: str, settings: Settings | None = None) -> bool:
    """Remove an adapter added at run time; AdapterError for one of the registry's."""
    if name in load_registry(settings or get_settings()).adapters:
        raise AdapterError(f"{name!r} is in the model registry file; remove it there")
    return bool(session.execute(delete(LoraAdapter).where(LoraAdapter.name == name)).rowcount)  # type: ignore[attr-defined]
