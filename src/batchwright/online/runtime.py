"""What an API process keeps for online requests: the relay and the rate limiter (one
async Redis client, made in the process's event loop) and the usage writer thread."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI

from batchwright.config import Settings, get_settings
from batchwright.errors import Unavailable
from batchwright.online.ratelimit import RateLimiter
from batchwright.online.usage import UsageWriter
from batchwright.relay.api_side import ApiRelay
from batchwright.relay.factory import api_relay


@dataclass
class Runtime:
    settings: Settings
    relay: ApiRelay
    limiter: RateLimiter
    usage: UsageWriter

    async def close(self) -> None:
        self.usage.stop()
        await self.relay.redis.aclose()


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
    made = Runtime(settings, relay, RateLimiter(relay.redis, settings.queue), usage)
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
