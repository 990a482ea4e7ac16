"""The relay's guarantees, end to end through Redis: one worker takes a request, events
come back in order from the worker that started it, cancels and deadlines reach the
worker, and a dead worker's requests go to another worker or end with an error."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio as aioredis

from batchwright.relay.api_side import ApiRelay
from batchwright.relay.messages import (
    WORKER_LOST,
    ChoiceDelta,
    Delta,
    Done,
    Failed,
    OnlineRequest,
    Started,
    Tick,
)
from batchwright.relay.worker_side import WorkerRelay
from tests.conftest import REDIS
from tests.online.relay.conftest import Relays, run, wait_for


@asynccontextmanager
async def api(relays: Relays, **options: float) -> AsyncIterator[ApiRelay]:
    client = aioredis.Redis.from_url(REDIS, socket_timeout=10)
    relay = ApiRelay(client, relays.queue, **options)  # type: ignore[arg-type]
    try:
        yield relay
    finally:
        await relay.close()
        await client.aclose()


def test_each_request_is_taken_by_exactly_one_worker(relays: Relays) -> None:
    requests = [relays.request() for _ in range(60)]

    async def submit() -> None:
        async with api(relays) as relay:
            for req in requests:
                await relay.submit(req)

    run(submit)
    taken: dict[str, list[str]] = {}

    def drain(name: str) -> None:
        worker = relays.worker(name, ["m"])
        while (got := worker.take(timeout=0.2)) is not None:
            taken.setdefault(got.request.id, []).append(name)

    threads = [threading.Thread(target=drain, args=(f"w{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(taken) == sorted(r.id for r in requests)
    assert all(len(names) == 1 for names in taken.values())


def test_a_worker_takes_only_its_models_and_wakes_on_a_submit(relays: Relays) -> None:
    both = relays.worker("both", ["a", "b"])
    only_a = relays.worker("only-a", ["a"])
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(both.take(timeout=60)))
    waiter.start()
    submit(relays, relays.request("b"))
    waiter.join()
    assert [t.request.model for t in got] == ["b"]  # type: ignore[attr-defined]
    submit(relays, relays.request("b"))
    assert only_a.take(timeout=0.1) is None
    taken = both.take(timeout=5)
    assert taken is not None and taken.request.model == "b"


def submit(relays: Relays, req: OnlineRequest) -> None:
    async def go() -> None:
        async with api(relays) as relay:
            await relay.submit(req)

    run(go)


def test_events_come_back_in_order_and_end_with_done(relays: Relays) -> None:
    worker = relays.worker("w", ["m"])
    req = relays.request()

    async def scenario() -> list[str]:
        async with api(relays) as relay:
            follower = await relay.submit(req)
            taken = worker.take(timeout=5)
            assert taken is not None and taken.request == req
            worker.publish([(taken.request, Started(worker="w", system_fingerprint="fp"))])
            for text in ("Hel", "lo"):
                delta = Delta(worker="w", choices=[ChoiceDelta(index=0, text=text, token_ids=[1])])
                worker.publish([(taken.request, delta)])
            worker.publish([(taken.request, Done(worker="w", completion={"id": req.id}))])
            assert worker.finish(taken)
            seen = []
            while True:
                event = await follower.next()
                assert event is not None
                seen.append(
                    event.type if not isinstance(event, Delta) else event.choices[0]["text"]
                )
                if isinstance(event, Done):
                    break
            assert follower.started is not None and follower.started.system_fingerprint == "fp"
            await follower.close()
            return seen

    assert run(scenario) == ["started", "Hel", "lo", "done"]
    assert not relays.redis.exists(worker.keys.events(req.id))


def test_no_worker_before_the_deadline_withdraws_the_request(relays: Relays) -> None:
    req = relays.request(deadline_in=0.3)

    async def scenario() -> object:
        async with api(relays) as relay:
            follower = await relay.submit(req)
            return await follower.next()

    assert run(scenario) is None
    # A worker that comes up afterwards never starts it.
    assert relays.worker("late", ["m"]).take(timeout=0.1) is None


def test_a_cancel_reaches_the_worker_that_holds_the_request(relays: Relays) -> None:
    worker = relays.worker("w", ["m"])
    held, waiting = relays.request(), relays.request()

    async def scenario() -> tuple[bool, bool]:
        async with api(relays) as relay:
            f_held = await relay.submit(held)
            taken = worker.take(timeout=5)
            assert taken is not None and taken.request.id == held.id
            f_waiting = await relay.submit(waiting)
            return await f_held.cancel(), await f_waiting.cancel()

    assert run(scenario) == (False, True)  # one was taken already, the other withdrawn
    assert worker.cancelled([held.id, "cmpl-other"]) == {held.id}
    assert worker.take(timeout=0.1) is None


def test_live_workers_are_those_whose_liveness_has_not_run_out(relays: Relays) -> None:
    relays.worker("steady", ["m"])
    short = relays.worker("short", ["m", "n"], ttl=0.2)

    async def live(model: str) -> list[str]:
        async with api(relays) as relay:
            return await relay.live_workers(model)

    assert run(lambda: live("m")) == ["short", "steady"]
    wait_for(lambda: run(lambda: live("n")) == [], what="short's liveness to run out")
    assert run(lambda: live("m")) == ["steady"]
    short.announce()
    assert run(lambda: live("n")) == ["short"]


def test_a_dead_workers_unstarted_request_goes_to_another_worker(relays: Relays) -> None:
    first = relays.worker("first", ["m"])
    req = relays.request()

    async def scenario() -> str:
        async with api(relays, liveness_check_seconds=0.05) as relay:
            follower = await relay.submit(req)
            assert first.take(timeout=5) is not None
            relays.kill(first)
            second = relays.worker("second", ["m"])
            box: list[str] = []

            def serve() -> None:
                taken = second.take(timeout=30)  # handed back by the API's reaper
                assert taken is not None
                second.publish([(taken.request, Started(worker="second"))])
                box.append(taken.request.id)

            thread = threading.Thread(target=serve)
            thread.start()
            event = await follower.next()
            thread.join()
            assert box == [req.id]
            assert isinstance(event, Started)
            return event.worker

    assert run(scenario) == "second"


def test_a_dead_workers_started_request_fails_and_a_resubmit_ignores_it(relays: Relays) -> None:
    first = relays.worker("first", ["m"])
    req = relays.request()

    async def scenario() -> list[str]:
        async with api(relays, liveness_check_seconds=0.05) as relay:
            follower = await relay.submit(req)
            taken = first.take(timeout=5)
            assert taken is not None
            first.publish([(taken.request, Started(worker="first"))])
            assert isinstance(await follower.next(), Started)
            relays.kill(first)
            lost = await follower.next()
            assert isinstance(lost, Failed) and lost.error["code"] == WORKER_LOST
            assert lost.status == 503
            await follower.resubmit()
            second = relays.worker("second", ["m"])
            again = second.take(timeout=5)
            assert again is not None and again.request.attempt == 1
            # The first worker was only frozen: what it sends now is not the client's.
            zombie = Delta(worker="first", choices=[ChoiceDelta(index=0, text="stale")])
            first.publish([(taken.request, zombie)])
            fresh = Delta(worker="second", choices=[ChoiceDelta(index=0, text="fresh")])
            second.publish([(again.request, Started(worker="second")), (again.request, fresh)])
            seen = []
            for _ in range(2):
                event = await follower.next()
                assert event is not None
                seen.append(f"{event.type}:{event.worker}")
            assert not first.finish(taken)  # handed back: nothing left to finish
            return seen

    assert run(scenario) == ["started:second", "delta:second"]


def test_a_request_that_keeps_losing_its_worker_ends(relays: Relays) -> None:
    req = relays.request()

    async def scenario() -> object:
        async with api(relays, liveness_check_seconds=0.05, max_requeues=2) as relay:
            follower = await relay.submit(req)
            for i in range(3):
                worker = relays.worker(f"w{i}", ["m"])
                assert worker.take(timeout=30) is not None
                relays.kill(worker)
                if i < 2:
                    assert await relay.reap("m") == (1, 0)
            return await follower.next()

    event = run(scenario)
    assert isinstance(event, Failed) and event.error["code"] == WORKER_LOST


def test_a_leaving_worker_hands_back_what_it_never_started(relays: Relays) -> None:
    leaving = relays.worker("leaving", ["m"])
    req = relays.request()
    submit(relays, req)
    assert leaving.take(timeout=5) is not None
    assert leaving.leave() == (1, 0)
    staying = relays.worker("staying", ["m"])
    taken = staying.take(timeout=5)
    assert taken is not None and taken.request.id == req.id


def test_stale_bells_do_not_keep_an_idle_worker_awake(relays: Relays) -> None:
    worker = relays.worker("w", ["m"])
    req = relays.request()

    async def submit_and_cancel() -> None:
        async with api(relays) as relay:
            follower = await relay.submit(req)
            await follower.cancel()

    run(submit_and_cancel)
    assert relays.redis.llen(worker.keys.bell("m")) == 1
    assert worker.take(timeout=0.05) is None
    assert relays.redis.llen(worker.keys.bell("m")) == 0


def test_a_request_may_end_before_any_started(relays: Relays) -> None:
    """Echo scoring needs no engine step: its Done can be the only event."""
    worker = relays.worker("w", ["m"])
    req = relays.request()

    async def scenario() -> object:
        async with api(relays) as relay:
            follower = await relay.submit(req)
            taken = worker.take(timeout=5)
            assert taken is not None
            worker.publish([(taken.request, Done(worker="w", completion={"id": req.id}))])
            return await follower.next()

    event = run(scenario)
    assert isinstance(event, Done) and event.worker == "w"


def test_hundreds_of_followers_wait_on_a_pool_of_four(relays: Relays) -> None:
    # Before: each follower held a pool connection for its XREAD BLOCK; a pool of four
    # (a blocking one, as the API's now is) could serve four waiting requests at a time.
    requests = [relays.request() for _ in range(300)]
    worker = relays.worker("w", ["m"])

    def answer_all() -> None:
        for _ in requests:
            taken = worker.take(timeout=30)
            assert taken is not None
            worker.publish([(taken.request, Done(worker="w", completion={"id": taken.request.id}))])

    async def scenario() -> list[object]:
        pool = aioredis.BlockingConnectionPool.from_url(REDIS, max_connections=4, timeout=5)
        client = aioredis.Redis(connection_pool=pool)
        relay = ApiRelay(client, relays.queue)
        try:
            followers = [await relay.submit(r) for r in requests]
            waiting = [asyncio.ensure_future(f.next()) for f in followers]
            await asyncio.sleep(0)  # every follower is waiting before any answer comes
            answering = asyncio.ensure_future(asyncio.to_thread(answer_all))
            events = await asyncio.wait_for(asyncio.gather(*waiting), 120)
            await answering
            return list(events)
        finally:
            await relay.close()
            await client.aclose()

    events = run(scenario)
    assert all(isinstance(e, Done) for e in events)
    assert sorted(e.completion["id"] for e in events) == sorted(r.id for r in requests)  # type: ignore[union-attr]


def test_a_started_request_whose_worker_goes_silent_is_given_up(relays: Relays) -> None:
    # The worker announces itself (alive) but its engine sends nothing: a stuck engine.
    worker = relays.worker("w", ["m"])
    req = relays.request()

    async def scenario() -> object:
        async with api(relays, liveness_check_seconds=0.05, idle_timeout_seconds=0.5) as relay:
            follower = await relay.submit(req)
            taken = worker.take(timeout=5)
            assert taken is not None
            worker.publish([(taken.request, Started(worker="w"))])
            assert isinstance(await follower.next(), Started)
            worker.publish([(taken.request, Tick(worker="w"))])  # ticks are not events
            return await asyncio.wait_for(follower.next(), 30)  # before: waited for good

    event = run(scenario)
    assert isinstance(event, Failed) and event.status == 503
    assert event.error["code"] == "engine_stalled"
    assert worker.cancelled([req.id]) == {req.id}  # the worker drops it too


def test_every_event_renews_its_stream_ttl(relays: Relays) -> None:
    # Before: a delta re-created a stream the API had deleted, with no TTL, for good.
    worker = relays.worker("w", ["m"])
    req = relays.request()
    delta = {"worker": "w", "type": "delta", "choices": []}
    worker.publish([(req, delta)])
    assert 0 < relays.redis.ttl(worker.keys.events(req.id)) <= 3600


def test_a_stream_nobody_reads_is_reported_once_its_unread_bytes_pass_the_bound(
    relays: Relays,
) -> None:
    worker = WorkerRelay(relays.redis, relays.queue, "w", ["m"], max_unread_bytes=4000)
    worker.announce()
    req = relays.request()
    delta = {"worker": "w", "type": "delta", "choices": [{"index": 0, "text": "x" * 500}]}

    async def scenario() -> list[bool]:
        async with api(relays) as relay:
            follower = await relay.submit(req)
            taken = worker.take(timeout=5)
            assert taken is not None
            worker.publish([(taken.request, Started(worker="w"))])
            lagging = []
            for _ in range(12):  # about 6 KB: past the bound while nobody reads
                lagging.append(req.id in worker.publish([(taken.request, dict(delta))]))
            # The reader takes them (and trims them from Redis): no longer lagging.
            for _ in range(13):
                await follower.next()
            events = worker.keys.events(req.id)
            while relays.redis.xlen(events) > 1:  # the reader's trim follows its read
                await asyncio.sleep(0.01)
            lagging.append(req.id in worker.publish([(taken.request, dict(delta))]))
            return lagging

    got = run(scenario)
    assert got[:5] == [False] * 5 and got[11] is True  # the bound passed while unread
    assert got[-1] is False  # read (and trimmed): the same stream is fine again
