"""POST /v1/completions: a Completion, or with `stream: true` Server-Sent Events; POST
/v1/embeddings: an embeddings list (never streamed), through the same path.

Order of business: the key (401 before the body is read), a slot of the process's and
the project's online requests (503 or 429 with Retry-After at once), the body (capped,
413; parsed and checked off the event loop when large), the validation batch lines get
(400, the same messages), the model (404), a text prompt too large for the model's
context (400), a live worker of the model (503 at once), the project's rate limits
(429), then the relay. Every answer up to the first chunk is plain JSON with its real
status, the worker's refusals too (context length, grammar, vocabulary, KV budget): a
stream starts (200) only once the worker sent something to show. After that an error
is a `data: {"error": …}` event and `[DONE]`, a Redis failure included. A client that
leaves cancels the request at the worker. Whatever way a request ends, it leaves a usage
row, its rate-limit charge is settled and its slot released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import anyio
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from redis.exceptions import RedisError
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from batchwright.api.responses import JSONBody
from batchwright.catalog import cached_registry
from batchwright.errors import APIError, InvalidRequest, NotFound, Unavailable
from batchwright.online.admission import Caller, admit
from batchwright.online.body import ClientGone, read_body
from batchwright.online.call import Call
from batchwright.online.chat_chunks import ChatChunkWriter
from batchwright.online.chunks import ChunkWriter, CompletionChunkWriter
from batchwright.online.requests import check_request, refused, relay_request
from batchwright.online.runtime import Runtime, runtime
from batchwright.protocol.embeddings import EmbeddingRequest
from batchwright.protocol.endpoints import CHAT, COMPLETIONS, EMBEDDINGS, task_error
from batchwright.relay.api_side import Follower
from batchwright.relay.messages import WORKER_LOST, Delta, Done, Event, Failed
from batchwright.relay.reader import ReaderDown

log = logging.getLogger(__name__)
router = APIRouter(tags=["completions"])
T = TypeVar("T")

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
# How long a client should wait after a 503 for a worker (none live, none took it).
_WORKER_RETRY_SECONDS = 5.0


def _json_error(exc: APIError, headers: dict[str, str] | None = None) -> JSONBody:
    merged = {**(headers or {}), **exc.headers()}
    return JSONBody(exc.body(), status_code=exc.status_code, headers=merged or None)


def _redis_down(exc: BaseException) -> Unavailable:
    log.warning("online request: Redis failed: %r", exc)
    return Unavailable(
        "The service's broker (Redis) is unavailable or overloaded; retry the request.",
        code="broker_unavailable",
        retry_after=1.0,
    )


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    return await _handle(request, COMPLETIONS)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    """The same path for chat requests: their body check, `chat.completion` answers and
    `chat.completion.chunk` events (online/chat_chunks.py)."""
    return await _handle(request, CHAT)


@router.post("/v1/embeddings", tags=["embeddings"])
async def create_embeddings(request: Request) -> Response:
    """Embeddings from a worker of an embedding model (engine/embed/), as the SDK's
    `client.embeddings.create` expects them."""
    return await _handle(request, EMBEDDINGS)


async def _handle(request: Request, endpoint: str) -> Response:
    try:
        rt = runtime(request.app)
        caller = await run_in_threadpool(admit, request.headers.get("authorization"))
    except APIError as exc:
        return _json_error(exc)
    call = Call(caller.project_id, caller.key_id)
    try:
        call.slot = rt.inflight.acquire(caller.project_id)
        return await _serve(request, rt, caller, call, endpoint)
    except ClientGone:
        call.gone()
        _finish(rt, caller, call)
        return Response(status_code=400)  # nobody reads it
    except APIError as exc:
        return _failed(rt, caller, call, exc)
    except (RedisError, ReaderDown) as exc:
        return _failed(rt, caller, call, _redis_down(exc))
    except Exception:
        log.exception("online request failed")
        return _failed(rt, caller, call, APIError("Internal server error."))


def _failed(rt: Runtime, caller: Caller, call: Call, exc: APIError) -> JSONBody:
    call.failed(exc)
    _finish(rt, caller, call)
    return _json_error(exc, call.headers)


async def _serve(
    request: Request, rt: Runtime, caller: Caller, call: Call, endpoint: str
) -> Response:
    raw = await read_body(request, rt.settings.max_json_body_bytes)
    checked = await check_request(endpoint, raw)
    call.requested = checked.requested
    if checked.error is not None or checked.req is None:
        raise checked.error or InvalidRequest("The request body is not valid.")
    req, body = checked.req, checked.body
    call.stream = bool(getattr(req, "stream", False))  # never for embeddings
    registry = await run_in_threadpool(cached_registry, rt.settings)
    spec = registry.serving(req.model)
    if spec is None:
        raise NotFound(
            f"The model '{req.model[:200]}' does not exist here; available: "
            f"{', '.join(registry.all_names)}.",
            param="model",
            code="model_not_found",
        )
    # Only a registry name from here on (metrics label it, the usage row keeps it).
    call.model = req.model
    why = task_error(endpoint, req.model, spec.kind)
    if why is not None:
        raise InvalidRequest(why, param="model", code="model_not_supported")
    # A LoRA adapter's requests go to its base model's workers (the body keeps its name).
    base = registry.base_of(req.model)
    await rt.prompt_fits(req, base)
    if not await rt.relay.live_workers(base):
        raise Unavailable(
            f"No worker is serving model '{base}' right now (none has a live heartbeat); "
            f"start one (`batchwright worker --models {base}`) or retry later.",
            code="model_not_served",
            retry_after=_WORKER_RETRY_SECONDS,
        )
    estimate, decision = await rt.charge(caller, req)
    call.headers.update(decision.headers)
    if not decision.allowed:
        raise refused(decision, caller.limits, estimate)
    call.charged_tokens = estimate
    online = relay_request(call.id, base, caller, body, rt.settings)
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
    if isinstance(first, Failed):
        # Refused before anything was shown (the worker's checks): its status, not a stream.
        await follower.close()
        raise _failure(first)
    if call.stream and not isinstance(req, EmbeddingRequest):
        chunks = ChatChunkWriter if endpoint == CHAT else CompletionChunkWriter
        writer = chunks(online, req.include_usage, _fingerprint(follower))
        stream = _Stream(first, follower, writer, rt, caller, call)
        headers = {**SSE_HEADERS, **call.headers}
        return _StreamResponse(stream, headers)
    return await _answer(request, first, follower, rt, caller, call)


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
                retry_after=_WORKER_RETRY_SECONDS,
            )
        if isinstance(event, Failed) and _retryable(event, follower):
            await follower.resubmit()
            continue
        if isinstance(event, Delta | Done | Failed):
            return event


def _retryable(event: Failed, follower: Follower) -> bool:
    return event.error.get("code") == WORKER_LOST and follower.request.attempt == 0


def _failure(event: Failed) -> APIError:
    retry = 1.0 if event.status in (429, 503) else None
    err = APIError(str(event.error.get("message") or "The request failed."), retry_after=retry)
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
    await _quietly(follower.close())
    if isinstance(end, Failed):
        return _failed(rt, caller, call, _failure(end))
    call.completed(end.completion)
    _finish(rt, caller, call)
    return JSONBody(end.completion, headers=call.headers or None)


class _Stream:
    """A streamed answer's chunks, and its end: whichever way it ends (done, failed, the
    client gone, Redis gone, or never iterated at all), `close` gives the request up if it
    did not end, writes its usage and settles its charge, once."""

    def __init__(
        self,
        first: Event,
        follower: Follower,
        writer: ChunkWriter,
        rt: Runtime,
        caller: Caller,
        call: Call,
    ) -> None:
        self.first: Event | None = first
        self.follower, self.writer = follower, writer
        self.rt, self.caller, self.call = rt, caller, call
        self.ended = False
        self.closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        writer, call = self.writer, self.call
        try:
            event, self.first = self.first, None
            while True:
                if event is None:
                    event = await self.follower.next()
                if isinstance(event, Delta):
                    before = writer.tokens
                    chunks = writer.delta(event)
                    # Counted as they are handed over, not after: a client that leaves
                    # while the first chunk is being sent never lets the generator resume
                    # past its yield, and its usage row had no time to first token (the
                    # intermittent failure of test_lifecycle's streamed-disconnect test).
                    call.chunk_sent(writer.tokens - before)
                    for chunk in chunks:
                        yield chunk
                elif isinstance(event, Done):
                    call.completed(event.completion)
                    self.ended = True
                    for chunk in writer.done(event.completion):
                        yield chunk
                    return
                elif isinstance(event, Failed):
                    call.failed_with(event.status, event.error)
                    self.ended = True
                    for chunk in writer.error(event.error):
                        yield chunk
                    return
                event = None
        except (RedisError, ReaderDown) as exc:
            err = _redis_down(exc)
            call.failed(err)
            for chunk in writer.error(err.body()["error"]):
                yield chunk
        finally:
            await self.close()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        call = self.call
        with anyio.CancelScope(shield=True):
            if not self.ended:
                if call.status == 200:
                    call.gone()
                call.completion_tokens = self.writer.tokens
                if self.follower.started is not None:
                    call.prompt_tokens = self.follower.started.prompt_tokens or 0
                await _give_up(self.follower)
            else:
                await _quietly(self.follower.close())
            _finish(self.rt, self.caller, call)


class _StreamResponse(StreamingResponse):
    """The SSE response; its stream is closed even when it never started (the client
    left before the first chunk went: Starlette then never iterates the generator)."""

    def __init__(self, stream: _Stream, headers: dict[str, str]) -> None:
        self.stream = stream
        super().__init__(stream.chunks(), media_type="text/event-stream", headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.stream.close()


async def _give_up(follower: Follower) -> None:
    with anyio.CancelScope(shield=True):
        await _quietly(follower.cancel())
        await _quietly(follower.close())


async def _quietly(work: Awaitable[Any]) -> None:
    """A clean-up step that must not keep the ones after it (usage, settlement) from
    running: Redis failing it is logged (the cancel key and events expire on their own)."""
    try:
        await work
    except (RedisError, OSError) as exc:
        log.warning("online request clean-up: %r", exc)


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
    """The request's end, once: metrics, its usage row, its slot, its charge settled."""
    if call.finished:
        return
    call.finished = True
    if call.slot is not None:
        call.slot.release()
    call.count()
    rt.usage.record(call.row())
    if call.charged_tokens:
        settle = rt.limiter.settle(caller.project_id, caller.limits, call.charged_tokens,
                                   call.used_tokens)  # fmt: skip
        _background(settle)


_tasks: set[Any] = set()


def _background(coro: Coroutine[Any, Any, None]) -> None:
    """Run a coroutine after the answer without waiting for it (kept referenced; a failure
    is logged: the bucket refills on its own)."""

    async def guarded() -> None:
        try:
            await coro
        except Exception as exc:
            log.warning("online request settlement: %r", exc)

    task = asyncio.ensure_future(guarded())
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
