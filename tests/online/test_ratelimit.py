"""The online rate limiter against the real Redis: a project's requests and tokens per
minute, charged atomically however many API processes ask at once, with OpenAI's headers."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio as aioredis

from batchwright.online.ratelimit import Limits, RateLimiter, estimate_tokens, reset_text
from batchwright.protocol.completions import CompletionRequest
from tests.conftest import REDIS


@asynccontextmanager
async def limiter() -> AsyncIterator[RateLimiter]:
    client = aioredis.Redis.from_url(REDIS, socket_timeout=10)
    queue = f"bw-limit-{uuid.uuid4().hex[:8]}"
    try:
        yield RateLimiter(client, queue)
    finally:
        keys = [k async for k in client.scan_iter(match=f"{queue}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


def test_requests_per_minute_admit_exactly_the_limit_under_concurrency() -> None:
    async def scenario() -> tuple[int, list[str]]:
        async with limiter() as lim:
            # Two API processes' worth of concurrent requests: the script is the only judge.
            decisions = await asyncio.gather(
                *(lim.acquire("proj_a", Limits(requests_per_minute=5), 1) for _ in range(40))
            )
            refused = [d for d in decisions if not d.allowed]
            return sum(d.allowed for d in decisions), [
                refused[0].headers["retry-after"],
                refused[0].headers["x-ratelimit-limit-requests"],
                refused[0].headers["x-ratelimit-remaining-requests"],
                str(refused[0].limited_by),
            ]

    admitted, headers = asyncio.run(scenario())
    assert admitted == 5
    # One request comes back every 12 s at 5 a minute.
    assert headers == ["12", "5", "0", "requests"]


def test_tokens_per_minute_and_settling_with_real_usage() -> None:
    async def scenario() -> list[object]:
        async with limiter() as lim:
            limits = Limits(tokens_per_minute=1000)
            first = await lim.acquire("proj_t", limits, 600)
            second = await lim.acquire("proj_t", limits, 600)  # 400 left: refused
            # The first used only 100 of the 600 it was charged: 500 come back.
            await lim.settle("proj_t", limits, 600, 100)
            third = await lim.acquire("proj_t", limits, 600)
            too_big = await lim.acquire("proj_t", limits, 1001)
            other = await lim.acquire("proj_other", limits, 600)  # projects are apart
            return [
                first.allowed,
                first.headers["x-ratelimit-remaining-tokens"],
                second.allowed,
                second.limited_by,
                third.allowed,
                too_big.allowed,
                too_big.retry_after,
                other.allowed,
            ]

    result = asyncio.run(scenario())
    assert result == [True, "400", False, "tokens", True, False, float("inf"), True]


def test_no_limits_no_headers() -> None:
    async def scenario() -> dict[str, str]:
        async with limiter() as lim:
            decision = await lim.acquire("proj_free", Limits(), 10**9)
            assert decision.allowed
            return decision.headers

    assert asyncio.run(scenario()) == {}


def test_estimates_and_reset_format() -> None:
    req = CompletionRequest.model_validate(
        {"model": "m", "prompt": ["abcdefgh", "abcd"], "max_tokens": 10, "n": 2}
    )
    assert estimate_tokens(req) == 3 + 10 * 4  # 2 + 1 prompt tokens, 4 sequences
    ids = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3], "max_tokens": 5})
    assert estimate_tokens(ids) == 3 + 5
    assert [reset_text(s) for s in (0.12, 1, 59.5, 360)] == ["120ms", "1s", "1m0s", "6m0s"]
