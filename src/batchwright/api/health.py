"""Liveness, readiness (database and broker reachable), model list."""

from __future__ import annotations

from fastapi import APIRouter, Request
from sqlalchemy import text

from batchwright.api.deps import ProjectDep, SettingsDep
from batchwright.api.metrics import metrics_reader
from batchwright.api.responses import JSONBody
from batchwright.catalog import registry
from batchwright.controlplane.heartbeats import adapter_holders, model_capacity, model_refusals
from batchwright.db.session import get_engine, session_scope
from batchwright.errors import NotFound
from batchwright.protocol.batches import ListObject, Model
from batchwright.registry import Registry

router = APIRouter()


@router.get("/healthz", tags=["health"])
def live() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", tags=["health"])
def ready(request: Request, settings: SettingsDep) -> JSONBody:
    """Whether the database and broker answer; with the metrics key, live workers per
    model too (what a deployment has is not a stranger's to read)."""
    checks: dict[str, str] = {}
    try:
        with get_engine().connect() as conn:
            conn.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"unreachable: {type(exc).__name__}"
    if not settings.broker_url:
        # Without a broker no batch is ever validated: the API alone is not ready.
        checks["broker"] = "not configured (BATCHWRIGHT_BROKER_URL)"
    else:
        try:
            import redis

            redis.Redis.from_url(settings.broker_url, socket_timeout=2).ping()
            checks["broker"] = "ok"
        except Exception as exc:
            checks["broker"] = f"unreachable: {type(exc).__name__}"
    ok = all(v == "ok" for v in checks.values())
    body: dict[str, object] = {"status": "ok" if ok else "unavailable", **checks}
    reader = metrics_reader(request.headers.get("authorization"), settings)
    if checks["database"] == "ok" and settings.broker_url and reader:
        body["models"] = model_capacity(settings)  # live workers per model
        with session_scope() as session:
            reg, held = registry(session, settings), adapter_holders(session, settings)
        # LoRA adapters: their base, and live workers holding them (read or in a slot).
        body["adapters"] = {
            name: {"base": a.base, "loaded_on": held.get(name, 0)}
            for name, a in sorted(reg.adapters.items())
        }
    return JSONBody(body, status_code=200 if ok else 503)


@router.get("/v1/models", tags=["models"])
def list_models(_: ProjectDep, settings: SettingsDep) -> ListObject[Model]:
    live = model_capacity(settings) if settings.broker_url else {}
    refused = model_refusals(settings) if settings.broker_url else {}
    reg = registry(None, settings)
    data = [_model(reg, name, live.get(name), refused.get(name)) for name in reg.all_names]
    return ListObject[Model](data=data, first_id=data[0].id, last_id=data[-1].id)


@router.get("/v1/models/{model_id}", tags=["models"])
def retrieve_model(model_id: str, _: ProjectDep, settings: SettingsDep) -> Model:
    reg = registry(None, settings)
    if reg.serving(model_id) is None:
        raise NotFound(
            f"The model '{model_id[:200]}' does not exist.", param="model", code="model_not_found"
        )
    return _model(reg, model_id, None)


def _model(reg: Registry, name: str, live: int | None, refused: str | None = None) -> Model:
    adapter = reg.adapters.get(name)
    if adapter is not None and refused is None:
        refused = None  # an adapter is served by its base's workers
    return Model(
        id=name,
        live_workers=live,
        parent=adapter.base if adapter else None,
        unavailable=refused,
    )
