"""The FastAPI application: the API's routers, the dashboard and the webhook outbox's hook
composed into one app. Never imports torch."""

from __future__ import annotations

from fastapi import FastAPI

from batchwright.api import errors, health, metrics
from batchwright.api.body_guard import BodyGuard
from batchwright.api.guards import RejectNulInURL
from batchwright.batches.endpoints import router as batches_router
from batchwright.controlplane.dispatch import CeleryDispatcher, set_dispatcher
from batchwright.dashboard import routes as dashboard
from batchwright.dashboard.security import SecurityHeaders
from batchwright.files.endpoints import router as files_router
from batchwright.online import endpoint as online
from batchwright.online.runtime import lifespan
from batchwright.webhooks import outbox


def create_app() -> FastAPI:
    app = FastAPI(title="batchwright", version="0.1.0", lifespan=lifespan)
    errors.install(app)
    app.add_middleware(BodyGuard)
    app.add_middleware(RejectNulInURL)
    app.add_middleware(SecurityHeaders)  # added last: runs first, sees every answer
    app.include_router(health.router)
    metrics.install(app)
    app.include_router(files_router)
    app.include_router(batches_router)
    app.include_router(online.router)
    app.include_router(dashboard.router)
    app.mount("/dashboard/static", dashboard.static, name="dashboard-static")
    set_dispatcher(CeleryDispatcher())
    outbox.install()
    return app
