"""POST /v1/completions: a Completion, or with `stream: true` Server-Sent Events.

Order of business: the key (401 before the body is read), the body (capped, 413), the
validation batch lines get (400, the same messages), the model (404), a live worker of
the model (503 at once), the project's rate limits (429), then the relay. Every answer up
to the first chunk is plain JSON with its real status: a stream starts (200) only once
the worker sent something to show. After that an error is a `data: {"error": …}` event
and `[DONE]`. A client that leaves cancels the request at the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import anyio
from fastapi import APIRouter, Request, Response
from fastapi.responses import ORJSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from batchwright.catalog import cached_registry
from batchwright.errors import APIError, InvalidRequest, NotFound, RateLimited, Unavailable
from batchwright.online.admission import Caller, admit
from batchwright.online.body import ClientGone, read_json
from batchwright.online.call import Call
from batchwright.online.chat_chunks import ChatChunkWriter
from batchwright.online.chunks import ChunkWriter
from batchwright.online.ratelimit import Decision, estimate_tokens
from batchwright.online.runtime import Runtime, runtime
from batchwright.protocol.endpoints import CHAT, COMPLETIONS, check_body
from batchwright.relay.api_side import Follower
from batchwright.relay.messages import WORKER_LOST, Delta, Done, Event, Failed, OnlineRequest

router = APIRouter(tags=["completions"])
T = TypeVar("T")

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def _json_error(exc: APIError, headers: dict[str, str] | None = None) -> ORJSONResponse:
    return ORJSONResponse(exc.body(), status_code=exc.status_code, headers=headers or None)


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    return await _handle(request, COMPLETIONS)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    """The same path for chat requests: their body check, `chat.completion` answers and
    `chat.completion.chunk` events (online/chat_chunks.py)."""
    return await _handle(request, CHAT)


async def _handle(request: Request, endpoint: str) -> Response:
    try:
        rt = runtime(request.app)
        caller = await run_in_threadpool(admit, request.headers.get("authorization"))
    except APIError as exc:
        return _json_error(exc)
    call = Call(caller.project_id, caller.key_id)
    try:
        return await _serve(request, rt, caller, call, endpoint)
    except ClientGone:
        call.gone()
        _finish(rt, caller, call)
        return Response(status_code=400)  # nobody reads it
    except APIError as exc:
        call.failed(exc)
        _finish(rt, caller, call)
        return _json_error(exc, call.headers)


async def _serve(
    request: Request, rt: Runtime, caller: Caller, call: Call, endpoint: str
) -> Response:
    body = await read_json(request, rt.settings.max_json_body_bytes)
    req, error = check_body(endpoint, body, online=True)
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        call.model = body["model"]
    if error is not None or req is None:
        err = error or {}
        raise InvalidRequest(str(err.get("message")), param=err.get("param"), code=err.get("code"))
    call.stream = bool(req.stream)
    registry = await run_in_threadpool(cached_registry, rt.settings)
    if registry.serving(req.model) is None:
        raise NotFound(
            f"The model '{req.model[:200]}' does not exist here; available: "
            f"{', '.join(registry.all_names)}.",
            param="model",
            code="model_not_found",
        )
    # A LoRA adapter's requests go to its base model's workers (the body keeps its name).
    base = registry.base_of(req.model)
    if not await rt.relay.live_workers(base):
        raise Unavailable(
            f"No worker is serving model '{base}' right now (none has a live heartbeat); "
            f"start one (`batchwright worker --models {base}`) or retry later.",
            code="model_not_served",
        )
    estimate = estimate_tokens(req)
    decision = await rt.limiter.acquire(caller.project_id, caller.limits, estimate)
    call.headers.update(decision.headers)
    if not decision.allowed:
        raise _refused(decision, caller, estimate)
    call.charged_tokens = estimate
    now = time.time()
    online = OnlineRequest(
        id=call.id,
        model=base,
        project_id=caller.project_id,
        key_id=caller.key_id,
        body=body,
        created=int(now),
        enqueued_at=now,
        deadline=now + rt.settings.online_queue_timeout_seconds,
    )
    follower = await rt.relay.submit(online)
    try:
        first = await _unless_gone(request, lambda: _first_output(follower, rt))
    except BaseException:
        await _give_up(follower)
        raise
    if first is None:  # the client left while the request waited
        await _give_up(follower)
        call.gone()
        _finish(rt, caller, call)
        return Response(status_code=499)
    if req.stream:
        chunks = ChatChunkWriter if endpoint == CHAT else ChunkWriter
        writer = chunks(online, req.include_usage, _fingerprint(follower))
        stream = _stream(first, follower, writer, rt, caller, call)
        headers = {**SSE_HEADERS, **call.headers}
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
    return await _answer(request, first, follower, rt, caller, call)


def _refused(decision: Decision, caller: Caller, estimate: int) -> RateLimited:
    limits = caller.limits
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


async def _first_output(follower: Follower, rt: Runtime) -> Event:
    """The first event with something for the client (a Delta, the Done, or a Failed):
    the request is handed again once if its worker died before that."""
    while True:
        event = await follower.next()
        if event is None:
            timeout = rt.settings.online_queue_timeout_seconds
            raise Unavailable(
                f"No worker of model '{follower.request.model}' started this request within "
                f"{timeout:g} s (BATCHWRIGHT_ONLINE_QUEUE_TIMEOUT_SECONDS): its workers are busy "
                "or gone. Retry later.",
                code="queue_timeout",
            )
        if isinstance(event, Failed) and _retryable(event, follower):
            await follower.resubmit()
            continue
        if isinstance(event, Delta | Done | Failed):
            return event


def _retryable(event: Failed, follower: Follower) -> bool:
    return event.error.get("code") == WORKER_LOST and follower.request.attempt == 0


def _failure(event: Failed) -> APIError:
    err = APIError(str(event.error.get("message") or "The request failed."))
    err.status_code = event.status
    err.type = str(
        event.error.get("type")
        or ("server_error" if event.status >= 500 else "invalid_request_error")
    )
    err.param, err.code = event.error.get("param"), event.error.get("code")
    return err


def _fingerprint(follower: Follower) -> str | None:
    return follower.started.system_fingerprint if follower.started else None


async def _answer(
    request: Request, event: Event, follower: Follower, rt: Runtime, caller: Caller, call: Call
) -> Response:
    """The non-streamed answer: the Done's Completion (retried once if its worker died)."""

    async def until_done() -> Done | Failed:
        current: Event | None = event
        while True:
            if isinstance(current, Done):
                return current
            if isinstance(current, Failed):
                if not _retryable(current, follower):
                    return current
                await follower.resubmit()
                current = await _first_output(follower, rt)
                continue
            current = await follower.next()

    try:
        end = await _unless_gone(request, until_done)
    except BaseException:
        await _give_up(follower)
        raise
    if end is None:
        await _give_up(follower)
        call.gone()
        if follower.started is not None:
            call.prompt_tokens = follower.started.prompt_tokens or 0
        _finish(rt, caller, call)
        return Response(status_code=499)
    await follower.close()
    if isinstance(end, Failed):
        exc = _failure(end)
        call.failed(exc)
        _finish(rt, caller, call)
        return _json_error(exc, call.headers)
    call.completed(end.completion)
    _finish(rt, caller, call)
    return ORJSONResponse(end.completion, headers=call.headers or None)


async def _stream(
    first: Event,
    follower: Follower,
    writer: ChunkWriter | ChatChunkWriter,
    rt: Runtime,
    caller: Caller,
    call: Call,
) -> AsyncIterator[bytes]:
    ended = False
    try:
        event: Event | None = first
        while True:
            if isinstance(event, Delta):
                before = writer.tokens
                for chunk in writer.delta(event):
                    yield chunk
                call.chunk_sent(writer.tokens - before)
            elif isinstance(event, Done):
                call.completed(event.completion)
                ended = True
                for chunk in writer.done(event.completion):
                    yield chunk
                return
            elif isinstance(event, Failed):
                call.failed_with(event.status, event.error)
                ended = True
                for chunk in writer.error(event.error):
                    yield chunk
                return
            event = await follower.next()
    finally:
        with anyio.CancelScope(shield=True):
            if not ended:
                call.gone()
                call.completion_tokens = writer.tokens
                if follower.started is not None:
                    call.prompt_tokens = follower.started.prompt_tokens or 0
                await _give_up(follower)
            else:
                await follower.close()
            _finish(rt, caller, call)


async def _give_up(follower: Follower) -> None:
    with anyio.CancelScope(shield=True):
        await follower.cancel()
        await follower.close()


async def _unless_gone(request: Request, work: Callable[[], Awaitable[T]]) -> T | None:
    """`work()`, or None as soon as the client disconnects (the work is cancelled)."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    worker = asyncio.ensure_future(work())
    try:
        done, _ = await asyncio.wait({watcher, worker}, return_when=asyncio.FIRST_COMPLETED)
        if worker in done:
            return worker.result()
        return None
    finally:
        for task in (watcher, worker):
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task


def _finish(rt: Runtime, caller: Caller, call: Call) -> None:
    call.count()
    rt.usage.record(call.row())
    if call.charged_tokens:
        settle = rt.limiter.settle(caller.project_id, caller.limits, call.charged_tokens,
                                   call.used_tokens)  # fmt: skip
        _background(settle)


_tasks: set[Any] = set()


def _background(coro: Coroutine[Any, Any, None]) -> None:
    """Run a coroutine after the answer without waiting for it (kept referenced)."""
    task = asyncio.ensure_future(coro)
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
