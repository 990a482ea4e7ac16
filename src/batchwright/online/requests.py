"""An online request's body, from bytes to what the relay carries.

The body is parsed and checked by the code batch lines go through (same 400s), off the
event loop when it is large or holds a `response_format` (a schema's check is work in
proportion to it, and the loop serves every other client meanwhile). Whatever a body makes
the checks raise is its 400, never a 500, and a body the relay cannot carry (JSON nested
past what orjson writes) is a 400 too, before anything is charged. A text prompt whose
bytes cannot fit the model's context even at the longest token of its vocabulary (what its
workers announce) is refused here, without tokenizing it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.concurrency import run_in_threadpool

from batchwright.config import Settings
from batchwright.errors import InvalidRequest, RateLimited
from batchwright.online.admission import Caller
from batchwright.online.ratelimit import Decision, Limits
from batchwright.protocol.chat import ChatCompletionRequest
from batchwright.protocol.embeddings import EmbeddingRequest
from batchwright.protocol.endpoints import LineRequest, check_body
from batchwright.relay.messages import OnlineRequest

# Bodies up to this size are checked on the event loop (a thread hop costs more).
_INLINE_BYTES = 16 * 1024


@dataclass
class Checked:
    requested: str  # the body's `model` when it is a string (the usage row's), else ""
    req: LineRequest | None
    body: dict[str, Any]
    error: InvalidRequest | None


async def check_request(endpoint: str, raw: bytes) -> Checked:
    """The validated request and its body, or the InvalidRequest (400) to answer."""
    if len(raw) > _INLINE_BYTES or b"response_format" in raw:
        return await run_in_threadpool(_check, endpoint, raw)
    return _check(endpoint, raw)


def _check(endpoint: str, raw: bytes) -> Checked:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        error = InvalidRequest(
            f"We could not parse the JSON body of your request: {exc}.", code="invalid_json"
        )
        return Checked("", None, {}, error)
    requested = body.get("model") if isinstance(body, dict) else None
    requested = requested if isinstance(requested, str) else ""
    try:
        req, problem = check_body(endpoint, body, online=True)
        if problem is None:
            orjson.dumps(body)  # what the relay will do with it
    except Exception as exc:
        # orjson writes at most 254 levels of nesting; RecursionError and the like too.
        deep = isinstance(exc, RecursionError) or "ecursion" in str(exc)
        why = "it nests deeper than 254 levels" if deep else type(exc).__name__
        error = InvalidRequest(
            f"The request body cannot be processed: {why}.", param=None, code="invalid_body"
        )
        return Checked(requested, None, {}, error)
    if problem is not None or req is None:
        err = problem or {}
        error = InvalidRequest(
            str(err.get("message")), param=err.get("param"), code=err.get("code")
        )
        return Checked(requested, None, {}, error)
    assert isinstance(body, dict)
    return Checked(requested, req, body, None)


def prompt_too_large(req: LineRequest, limits: dict[str, Any] | None) -> InvalidRequest | None:
    """A 400 for a text prompt longer in bytes than the model's context could hold even if
    every token were its vocabulary's longest; None when it may fit (or nothing is known
    of the model yet: its worker checks it then)."""
    if not limits:
        return None
    context = int(limits.get("context_length") or 0)
    per_token = int(limits.get("max_token_bytes") or 0)
    if context <= 0 or per_token <= 0:
        return None
    bound = context * per_token
    if isinstance(req, EmbeddingRequest):
        return None  # each input is checked against the context where it is tokenized
    if isinstance(req, ChatCompletionRequest):
        size, param = sum(len(m.text.encode()) for m in req.messages), "messages"
    else:
        prompts: list[Any] = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
        size = max((len(p.encode()) for p in prompts if isinstance(p, str)), default=0)
        param = "prompt"
    if size <= bound:
        return None
    return InvalidRequest(
        f"This model's maximum context length is {context} tokens, and your {param} of "
        f"{size} bytes cannot fit in it: no token of the model's vocabulary is longer than "
        f"{per_token} bytes. Please reduce the length of the {param}.",
        param=param,
        code="context_length_exceeded",
    )


def refused(decision: Decision, limits: Limits, estimate: int) -> RateLimited:
    if decision.retry_after == float("inf"):
        return RateLimited(
            f"Request too large for the project's online tokens per minute: limit "
            f"{limits.tokens_per_minute}, requested about {estimate} (prompt and max_tokens for "
            "every sequence). Lower max_tokens or n, or split the prompts.",
            limit="tokens",
        )
    per_minute = (
        limits.requests_per_minute
        if decision.limited_by == "requests"
        else limits.tokens_per_minute
    )
    return RateLimited(
        f"Rate limit reached for the project's online {decision.limited_by} per minute: limit "
        f"{per_minute}. Please try again in {decision.retry_after:.1f} s.",
        limit=decision.limited_by or "requests",
    )


def relay_request(
    request_id: str, model: str, caller: Caller, body: dict[str, Any], settings: Settings
) -> OnlineRequest:
    now = time.time()
    return OnlineRequest(
        id=request_id,
        model=model,
        project_id=caller.project_id,
        key_id=caller.key_id,
        body=body,
        created=int(now),
        enqueued_at=now,
        deadline=now + settings.online_queue_timeout_seconds,
    )
