"""The engine host: one engine loop per model that leases attach to and detach from, that
online requests wake, and that decodes fewer rows at once after running out of memory.

The engine here is a stand-in with Engine.run's contract (lines in, a result per line
out, the cancel hook asked each step, WAKE to look at online requests), so each test says
what the loop around it does; the model's own tests are tests/engine's."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest

from batchwright.engine.requests.types import WAKE, GenRequest, GenResult

TIMEOUT = 30.0


class OutOfMemoryError(RuntimeError):
    """torch.OutOfMemoryError as the worker knows it: by name (controlplane/budget.py)."""


class StandInEngine:
    """Answers each line at the step it comes in; `fail` decides a step's failure."""

    def __init__(self, max_rows: int = 8) -> None:
        self.max_rows = max_rows
        self.runs = 0
        self.answered: list[Any] = []
        self.fail: Callable[[StandInEngine], BaseException | None] = lambda _: None
        self.gate: threading.Event | None = None  # held closed: a line waits in the engine

    def run(
        self, requests: Iterable[Any], cancelled: Any = None, online: Any = None
    ) -> Iterator[GenResult]:
        self.runs += 1
        for item in requests:
            if online is not None:
                for req in online.take():
                    yield _answer(req)
            if item is WAKE:
                continue
            error = self.fail(self)
            if error is not None:
                raise error
            if self.gate is not None:
                self.gate.wait(TIMEOUT)
            dropped = cancelled() if cancelled is not None else set()
            if item.key in dropped:
                continue
            self.answered.append(item.key)
            yield _answer(item)


def _answer(req: Any) -> GenResult:
    return GenResult(key=req.key, status_code=200, completion={"id": f"cmpl-{req.key}"})


class Online:
    """The online pump's face to the host (worker/generation/pump.py's RelayPump,
    without its relay): requests come in, finished ones go back."""

    def __init__(self) -> None:
        self.inbox: list[GenRequest] = []
        self.live: set[Any] = set()
        self.done: dict[Any, GenResult] = {}
        self.arrived = threading.Condition()

    def submit(self, host: Any, key: str) -> None:
        with self.arrived:
            self.inbox.append(GenRequest(key, {"prompt": key}))
            self.live.add(key)
        host.wake()

    def waiting(self) -> bool:
        return bool(self.inbox)

    def owns(self, key: Any) -> bool:
        return key in self.live

    def take(self) -> list[GenRequest]:
        with self.arrived:
            taken, self.inbox = self.inbox, []
        return taken

    def finished(self, result: GenResult) -> None:
        with self.arrived:
            self.live.discard(result.key)
            self.done[result.key] = result
            self.arrived.notify_all()

    def cancelled(self) -> set[Any]:
        return set()

    def fail_all(self, exc: BaseException) -> None:
        pass

    def stop(self) -> None:
        pass

    def leave(self) -> None:
        pass

    def wait_done(self, key: str) -> GenResult:
        with self.arrived:
            assert self.arrived.wait_for(lambda: key in self.done, TIMEOUT), key
            return self.done[key]


def _host(engine: StandInEngine, online: Online | None = None) -> Any:
    from batchwright.worker.generation.engine_host import EngineHost

    host = EngineHost(
        "demo",
        lambda: engine,  # type: ignore[arg-type,return-value]
        orders_ahead=False,
        online=(lambda _h: online) if online is not None else None,  # type: ignore[arg-type,return-value]
    )
    host.start()
    assert host.loaded.wait(TIMEOUT)
    return host


def _lines(n: int, batch: str = "b1") -> list[GenRequest]:
    return [GenRequest((i, batch), {"prompt": str(i)}, group=batch) for i in range(n)]


@pytest.fixture
def engine() -> Iterator[StandInEngine]:
    yield StandInEngine()


def test_an_attached_lease_gets_a_result_for_each_line_then_detaches(
    engine: StandInEngine,
) -> None:
    host = _host(engine)
    try:
        got: list[GenResult] = []
        host.run_lease(_lines(5), got.append)
        assert sorted(r.key for r in got) == [(i, "b1") for i in range(5)]
        assert host.attached is None
        # The loop lives on: a second lease runs in the same run of the engine.
        more: list[GenResult] = []
        host.run_lease(_lines(3, "b2"), more.append)
        assert len(more) == 3 and engine.runs == 1
    finally:
        host.stop(TIMEOUT)


def test_a_lease_whose_sink_fails_is_detached_alone(engine: StandInEngine) -> None:
    """The task sees its error; the loop, and the next lease, run on."""
    host = _host(engine)
    try:

        def broken(result: GenResult) -> None:
            raise ConnectionError("result queue gone")

        with pytest.raises(ConnectionError):
            host.run_lease(_lines(4), broken)
        assert host.attached is None
        got: list[GenResult] = []
        host.run_lease(_lines(2, "b2"), got.append)
        assert [r.key[1] for r in got] == ["b2", "b2"]
        assert engine.runs == 1
    finally:
        host.stop(TIMEOUT)


def test_a_second_lease_waits_for_the_first_to_detach(engine: StandInEngine) -> None:
    engine.gate = threading.Event()
    host = _host(engine)
    try:
        landed: list[Any] = []  # both leases' results, in the order they came out
        t1 = threading.Thread(target=host.run_lease, args=(_lines(2, "b1"), landed.append))
        t1.start()
        with host._cond:  # b1 is attached (its first line is held in the engine)
            assert host._cond.wait_for(lambda: host.attached is not None, TIMEOUT)
        t2 = threading.Thread(target=host.run_lease, args=(_lines(2, "b2"), landed.append))
        t2.start()
        engine.gate.set()
        t1.join(TIMEOUT)
        t2.join(TIMEOUT)
        assert [r.key[1] for r in landed] == ["b1", "b1", "b2", "b2"]
    finally:
        engine.gate.set()
        host.stop(TIMEOUT)


def test_an_online_request_wakes_the_idle_loop(engine: StandInEngine) -> None:
    online = Online()
    host = _host(engine, online)
    try:
        # No lease attached: the loop waits for input inside its request source.
        online.submit(host, "online-1")
        assert online.wait_done("online-1").status_code == 200
        # And again, after it went back to waiting.
        online.submit(host, "online-2")
        assert online.wait_done("online-2").status_code == 200
    finally:
        host.stop(TIMEOUT)


def test_out_of_memory_halves_the_rows_until_the_lease_runs(engine: StandInEngine) -> None:
    """Each out-of-memory fails the attached lease (its task gives the lines back and
    sends itself again, runner.process) and the next run decodes half the rows."""
    engine.fail = lambda e: OutOfMemoryError("CUDA out of memory") if e.max_rows > 2 else None
    host = _host(engine)
    try:
        for rows_after in (4, 2):
            with pytest.raises(OutOfMemoryError):
                host.run_lease(_lines(3), lambda _r: None)
            assert engine.max_rows == rows_after
        got: list[GenResult] = []
        host.run_lease(_lines(3), got.append)
        assert len(got) == 3 and engine.max_rows == 2
        assert engine.runs == 3  # a fresh run after each failure
    finally:
        host.stop(TIMEOUT)


def test_out_of_memory_with_one_row_fails_the_lease_for_good(engine: StandInEngine) -> None:
    """Nothing left to halve: the lease fails with an error that says so (not an
    out-of-memory, which the task would answer by sending itself again)."""
    engine.max_rows = 1
    engine.fail = lambda _e: OutOfMemoryError("CUDA out of memory")
    host = _host(engine)
    try:
        with pytest.raises(RuntimeError, match="out of memory with one row") as raised:
            host.run_lease(_lines(2), lambda _r: None)
        assert type(raised.value) is RuntimeError
        assert engine.max_rows == 1
    finally:
        host.stop(TIMEOUT)


class WatchedEngine(StandInEngine):
    """A stand-in that tells its observers of a forward and a result per line."""

    def __init__(self) -> None:
        super().__init__()
        self.observers: list[Any] = []

    def observe(self, observer: Any) -> None:
        if observer not in self.observers:
            self.observers.append(observer)

    def run(
        self, requests: Iterable[Any], cancelled: Any = None, online: Any = None
    ) -> Iterator[GenResult]:
        for result in super().run(requests, cancelled, online):
            for observer in self.observers:
                observer.forward(0.001, 1)
                observer.finished(result)
            yield result


def test_a_watcher_sees_steps_forwards_and_results_while_it_watches() -> None:
    """What the embedded run's progress line and Ctrl-C use (runs/worker.py)."""
    from batchwright.worker.generation.engine_host import HostObserver

    class Watcher(HostObserver):
        def __init__(self) -> None:
            self.steps = self.forwards = 0
            self.results: list[Any] = []

        def step(self) -> None:
            self.steps += 1

        def forward(self, seconds: float, prompt_tokens: int) -> None:
            self.forwards += 1

        def finished(self, result: GenResult) -> None:
            self.results.append(result.key)

    engine = WatchedEngine()
    host = _host(engine)
    watcher = Watcher()
    try:
        host.observe(watcher)
        host.run_lease(_lines(3), lambda _r: None)
        assert sorted(watcher.results) == [(i, "b1") for i in range(3)]
        assert watcher.forwards == 3 and watcher.steps >= 3
        host.unobserve(watcher)
        host.run_lease(_lines(2, "b2"), lambda _r: None)
        assert len(watcher.results) == 3
    finally:
        host.stop(TIMEOUT)


def test_an_engine_without_a_worker_host_gets_one_kept_for_its_next_lease(
    engine: StandInEngine,
) -> None:
    """runner.process's host where the worker started none (the embedded run): one per
    engine, kept with its run between leases; a new engine of the model retires it."""
    from batchwright.worker.generation import engine_host

    got: list[GenResult] = []
    try:
        with engine_host.local("demo", engine, orders_ahead=False) as host:
            host.run_lease(_lines(3), got.append)
        with engine_host.local("demo", engine, orders_ahead=False) as again:
            assert again is host
            again.run_lease(_lines(2, "b2"), got.append)
        assert len(got) == 5 and engine.runs == 1  # one run of the engine for both
        with engine_host.local("demo", StandInEngine(), orders_ahead=False) as other:
            assert other is not host
        assert host.stopping  # idle, for an engine of the model no longer used
    finally:
        engine_host.stop_local()
