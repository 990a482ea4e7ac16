"""What an API process keeps for online requests: the relay and the rate limiter (async
Redis clients, made in the process's event loop), its in-flight counts, what workers
announced of their models, and the usage writer thread."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI

from batchwright.config import Settings, get_settings
from batchwright.errors import Unavailable
from batchwright.online.admission import Caller
from batchwright.online.inflight import InFlight
from batchwright.online.ratelimit import Decision, RateLimiter, estimate_tokens
from batchwright.online.requests import prompt_too_large
from batchwright.online.usage import UsageWriter
from batchwright.protocol.endpoints import LineRequest
from batchwright.relay.api_side import ApiRelay
from batchwright.relay.factory import api_relay

# How long what workers announced of a model is kept before it is read again.
_LIMITS_SECONDS = 5.0


@dataclass
class Runtime:
    settings: Settings
    relay: ApiRelay
    limiter: RateLimiter
    usage: UsageWriter
    inflight: InFlight
    _limits: dict[str, tuple[float, dict[str, Any] | None]] = field(default_factory=dict)

    async def close(self) -> None:
        self.usage.stop()
        await self.relay.close()
        await self.relay.redis.aclose()

    async def prompt_fits(self, req: LineRequest, model: str) -> None:
        """Raises the 400 of a text prompt the context of `model` (the one whose workers
        serve it: a LoRA adapter's base) cannot hold."""
        now = time.monotonic()
        at, limits = self._limits.get(model, (0.0, None))
        if now - at > _LIMITS_SECONDS:
            limits = await self.relay.model_limits(model)
            self._limits[model] = (now, limits)
        error = prompt_too_large(req, limits)
        if error is not None:
            raise error

    async def charge(self, caller: Caller, req: LineRequest) -> tuple[int, Decision]:
        estimate = estimate_tokens(req)
        return estimate, await self.limiter.acquire(caller.project_id, caller.limits, estimate)


def runtime(app: FastAPI) -> Runtime:
    """The app's runtime, made on first use (inside the event loop that serves it)."""
    found: Runtime | None = getattr(app.state, "online", None)
    if found is not None:
        return found
    settings = get_settings()
    if not settings.broker_url:
        raise Unavailable(
            "Online completions need Redis: set BATCHWRIGHT_BROKER_URL (the embedded "
            "default runs batch files only).",
            code="online_unavailable",
        )
    relay = api_relay(settings)
    usage = UsageWriter(settings.online_usage_buffer, settings.online_usage_flush_seconds)
    usage.start()
    inflight = InFlight(settings.online_max_in_flight, settings.online_max_in_flight_per_project)
    made = Runtime(settings, relay, RateLimiter(relay.redis, settings.queue), usage, inflight)
    app.state.online = made
    return made


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Shutdown writes the usage rows still waiting."""
    yield
    found: Runtime | None = getattr(app.state, "online", None)
    if found is not None:
        app.state.online = None
        await found.close()
