"""Per-project online rate limits: requests per minute and tokens per minute, each a token
bucket in Redis (refilled continuously, full after a minute idle), checked and charged
atomically by a Lua script with Redis's clock, so every API process shares them.

A request is charged an estimate of its tokens when admitted (the API has no tokenizer:
about 4 bytes a token for text prompts, exact for token ids, plus max_tokens for every
sequence) and settled with its real usage when it ends. Headers follow OpenAI's:
`x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, and `Retry-After` on a 429.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from batchwright.protocol.chat import ChatCompletionRequest
from batchwright.protocol.completions import CompletionRequest
from batchwright.protocol.embeddings import EmbeddingRequest

# KEYS: requests bucket, tokens bucket. ARGV: requests/min, tokens/min (0: none), tokens.
# -> {1 admitted | 0 refused, seconds to wait, requests level, tokens level} as strings.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local limits = {tonumber(ARGV[1]), tonumber(ARGV[2])}
local costs = {1, tonumber(ARGV[3])}
local levels = {-1, -1}
local wait = 0
for i = 1, 2 do
  local limit = limits[i]
  if limit > 0 then
    local h = redis.call('HMGET', KEYS[i], 'level', 'ts')
    local level = tonumber(h[1]) or limit
    local ts = tonumber(h[2]) or now
    level = math.min(limit, level + math.max(0, now - ts) * limit / 60)
    levels[i] = level
    if level < costs[i] then wait = math.max(wait, (costs[i] - level) * 60 / limit) end
  end
end
if wait == 0 then
  for i = 1, 2 do
    if limits[i] > 0 then
      levels[i] = levels[i] - costs[i]
      redis.call('HSET', KEYS[i], 'level', tostring(levels[i]), 'ts', tostring(now))
      redis.call('EXPIRE', KEYS[i], 3600)
    end
  end
end
return {wait == 0 and 1 or 0, tostring(wait), tostring(levels[1]), tostring(levels[2])}
"""

# KEYS: tokens bucket. ARGV: tokens/min, tokens to give back (negative: to take).
_SETTLE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local limit = tonumber(ARGV[1])
local h = redis.call('HMGET', KEYS[1], 'level', 'ts')
local level = tonumber(h[1]) or limit
local ts = tonumber(h[2]) or now
level = math.min(limit, level + math.max(0, now - ts) * limit / 60 + tonumber(ARGV[2]))
redis.call('HSET', KEYS[1], 'level', tostring(level), 'ts', tostring(now))
redis.call('EXPIRE', KEYS[1], 3600)
return tostring(level)
"""


@dataclass(frozen=True)
class Limits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    @property
    def any(self) -> bool:
        return bool(self.requests_per_minute or self.tokens_per_minute)


@dataclass
class Decision:
    allowed: bool
    # Which limit refused it ("requests" or "tokens"), how long until it would pass.
    limited_by: str | None = None
    retry_after: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


def estimate_tokens(req: CompletionRequest | ChatCompletionRequest | EmbeddingRequest) -> int:
    """Prompt tokens (estimated for text) plus max_tokens for every sequence. A chat
    request without a completion limit is charged its prompt (settled with its usage); an
    embeddings request its inputs."""
    if isinstance(req, EmbeddingRequest):
        return max(
            1,
            sum(
                len(x) if isinstance(x, list) else math.ceil(len(x.encode()) / 4)
                for x in req.inputs
            ),
        )
    if isinstance(req, ChatCompletionRequest):
        text = sum(math.ceil(len(m.text.encode()) / 4) + 4 for m in req.messages)
        return max(1, text) + (req.max_new_tokens or 0) * req.n
    prompts: list[Any] = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
    if prompts and isinstance(prompts[0], int):
        prompt_tokens = len(prompts)
        prompts = [prompts]
    else:
        prompt_tokens = sum(
            len(p) if isinstance(p, list) else math.ceil(len(p.encode()) / 4) for p in prompts
        )
    return max(1, prompt_tokens) + req.max_tokens * req.sequences


def reset_text(seconds: float) -> str:
    """OpenAI's reset format: 120ms, 1s, 6m0s."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


class RateLimiter:
    def __init__(self, client: aioredis.Redis, queue: str) -> None:
        self.redis = client
        self.prefix = f"{queue}:ratelimit"
        self._acquire = client.register_script(_ACQUIRE)
        self._settle = client.register_script(_SETTLE)

    def _keys(self, project_id: str) -> list[str]:
        return [f"{self.prefix}:{project_id}:requests", f"{self.prefix}:{project_id}:tokens"]

    async def acquire(self, project_id: str, limits: Limits, tokens: int) -> Decision:
        if not limits.any:
            return Decision(True)
        rpm, tpm = limits.requests_per_minute or 0, limits.tokens_per_minute or 0
        if tpm and tokens > tpm:
            return Decision(False, "tokens", math.inf, _headers(rpm, tpm, None, None))
        ok, wait, req_level, tok_level = await self._acquire(
            keys=self._keys(project_id), args=[rpm, tpm, tokens]
        )
        levels = float(req_level), float(tok_level)
        headers = _headers(rpm, tpm, *levels)
        if int(ok):
            return Decision(True, headers=headers)
        # The limit that needs the longest wait is the one to name.
        need_req = rpm and levels[0] < 1
        limited_by = "requests" if need_req and (not tpm or levels[1] >= tokens) else "tokens"
        seconds = float(wait)
        headers["retry-after"] = str(max(1, math.ceil(seconds)))
        headers["retry-after-ms"] = str(max(1, math.ceil(seconds * 1000)))
        return Decision(False, limited_by, seconds, headers)

    async def settle(self, project_id: str, limits: Limits, charged: int, used: int) -> None:
        """Give back what the estimate charged beyond the real usage (or take the excess)."""
        if limits.tokens_per_minute and charged != used:
            await self._settle(
                keys=self._keys(project_id)[1:], args=[limits.tokens_per_minute, charged - used]
            )


def _headers(
    rpm: int, tpm: int, req_level: float | None, tok_level: float | None
) -> dict[str, str]:
    headers: dict[str, str] = {}
    for name, limit, level in (("requests", rpm, req_level), ("tokens", tpm, tok_level)):
        if not limit:
            continue
        headers[f"x-ratelimit-limit-{name}"] = str(limit)
        if level is None:
            continue
        headers[f"x-ratelimit-remaining-{name}"] = str(max(0, math.floor(level)))
        headers[f"x-ratelimit-reset-{name}"] = reset_text((limit - level) * 60 / limit)
    return headers
