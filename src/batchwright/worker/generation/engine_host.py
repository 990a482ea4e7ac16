"""The engine host: every engine runs in one, a thread that runs `Engine.run` for as long
as the model is loaded.

In a worker's generation process there is one per served model (hosts.py): batch lines
and online requests share the model's rows, so they share one loop. Elsewhere (the
embedded `batchwright run`, a task run where the worker started no host) an engine gets a
host of its own at its first lease (`local`), kept for the next: the same loop without
online work. A `process` task attaches its lease to it (`run_lease`: the lease's lines go
in, its results come out, its cancels drop lines, all called from the loop's thread) and
waits until every line it handed over has come back. The lease is a local source of lines
(claim and write threads of this process) or a remote one (a lease process over a socket
pair: lease_process.py); the host sees no difference. Online requests reach the same loop
through `pump.RelayPump`, so one is admitted at the loop's next step whether or not a
batch is running (engine/scheduling/lane.py puts it ahead of the batch lines, preempting
them if need be). Who watches the engine (the embedded run's progress line) does so
through the host (`observe`).

With nothing to do the loop waits inside its request source for a lease or an online
request (engine/requests/types.py's WAKE ends that wait for the latter). A lease whose
source or sink fails is detached alone: its lines leave the engine at the next step and
the task sees the error; online requests run on. An error of the engine itself fails what
it held (lease and online requests) and the loop starts over with a fresh run.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from batchwright.engine.requests.observer import Observer
from batchwright.engine.requests.types import WAKE, GenResult, ModelRefused, Wake
from batchwright.serving.prepare import Prepare, preparer_for
from batchwright.serving.wire import Wire
from batchwright.worker.lease_child.claims import is_out_of_memory
from batchwright.worker.lease_child.pipeline import Line

if TYPE_CHECKING:
    from batchwright.engine.engine import Engine
    from batchwright.worker.generation.pump import RelayPump

log = logging.getLogger(__name__)

Put = Callable[[GenResult], None]
Cancels = Callable[[], AbstractSet[Any]]


class HostObserver(Observer):
    """Watching a host's engine (`EngineHost.observe`): its forwards and results as an
    engine's Observer is told of them, and each step. Called on the loop's thread."""

    def step(self) -> None:
        """A step begins (before its forward)."""


class _Relay(Observer):
    """An engine's one observer for its hosts: passes forwards and results on to the
    observers its host (the latest one to run it) holds at the time."""

    def __init__(self, host: EngineHost) -> None:
        self.host = host

    @staticmethod
    def to(host: EngineHost) -> None:
        """Relay what `host`'s engine tells to `host` (a test's stand-in may tell nothing)."""
        engine = host.engine
        if not hasattr(engine, "observe"):
            return
        for observer in getattr(engine, "observers", ()):
            if isinstance(observer, _Relay):
                observer.host = host
                return
        engine.observe(_Relay(host))

    def forward(self, seconds: float, prompt_tokens: int) -> None:
        for observer in self.host.observers:
            observer.forward(seconds, prompt_tokens)

    def finished(self, result: GenResult) -> None:
        for observer in self.host.observers:
            observer.finished(result)


class Attachment:
    """A lease's lines while they run in the host's loop."""

    def __init__(self, source: Iterable[Line], put: Put, cancelled: Cancels | None) -> None:
        self.source = source
        self.it = iter(source)
        self.put = put
        self.cancelled = cancelled
        self.keys: set[Any] = set()  # lines handed to the engine without a result yet
        self.ended = False  # the source has no more lines
        self.error: BaseException | None = None
        self.done = threading.Event()

    def ready(self) -> int:
        """Lines to take now; one more when the source is at its end, so the engine asks
        for it and learns of the end while rows still run."""
        ready = getattr(self.source, "ready", None)
        n = int(ready()) if ready is not None else 0
        at_end = getattr(self.source, "at_end", None)
        return n + int(at_end is not None and bool(at_end()))


class EngineHost:
    """`load` runs in the loop's thread (the one that runs the model: torch's CPU threads
    are set there); `online` starts the model's online work once it loaded."""

    def __init__(
        self,
        model: str,
        load: Callable[[], Engine],
        *,
        orders_ahead: bool,
        online: Callable[[EngineHost], RelayPump] | None = None,
    ) -> None:
        self.model = model
        self.orders_ahead = orders_ahead
        self._load = load
        self._start_online = online
        self.engine: Engine = None  # type: ignore[assignment]  # set by the loop's thread
        # The engine's preparer (serving/prepare.py), set with it: whoever hands it lines
        # parses and tokenizes them with it, off the loop's thread. None: the engine takes
        # lines as they are (an embedding model's runner, a test's stand-in).
        self.prepare: Prepare | None = None
        self.loaded = threading.Event()  # set once loading ended, well or not
        self.online: RelayPump | None = None
        self.attached: Attachment | None = None
        self.stopping = False
        # Who watches the engine (observe): replaced whole, read on the loop's thread.
        self.observers: tuple[HostObserver, ...] = ()
        self._cond = threading.Condition()
        self._dropped: set[Any] = set()  # lines of a detached lease still in the engine
        self._lines = _Lines(self, orders_ahead)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"engine-{model}")

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Take nothing more; the loop ends once what it holds is done."""
        if self.online is not None:
            self.online.stop()
        with self._cond:
            self.stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self.online is not None:
            self.online.leave()

    def observe(self, observer: HostObserver) -> None:
        """Tell `observer` of the engine's forwards, results and steps, until `unobserve`."""
        with self._cond:
            if observer not in self.observers:
                self.observers = (*self.observers, observer)

    def unobserve(self, observer: HostObserver) -> None:
        with self._cond:
            self.observers = tuple(o for o in self.observers if o is not observer)

    def wake(self) -> None:
        """Something came for the loop (an online request): end its wait for input."""
        with self._cond:
            self._cond.notify_all()

    # --- a process task's lease ----------------------------------------------------------

    def run_lease(self, source: Iterable[Line], put: Put, cancelled: Cancels | None = None) -> None:
        """Run a lease's lines in the loop; returns once each line it handed over has its
        result (or was cancelled). `source`, `put` and `cancelled` are called from the
        loop's thread only, and not after this returns. Raises what failed the lease."""
        att = Attachment(source, put, cancelled)
        with self._cond:
            while self.attached is not None and not self.stopping:
                self._cond.wait()
            if self.stopping:
                raise RuntimeError(f"the engine of {self.model} is stopping")
            self.attached = att
            self._cond.notify_all()
        att.done.wait()
        if att.error is not None:
            raise att.error

    def _finish(self, att: Attachment, error: BaseException | None = None) -> None:
        """The lease leaves the loop: its lines still in the engine are dropped."""
        if att.done.is_set():
            return
        att.error = error
        self._dropped |= att.keys
        att.keys.clear()
        with self._cond:
            if self.attached is att:
                self.attached = None
            self._cond.notify_all()
        att.done.set()

    def _check(self, att: Attachment) -> None:
        if att.ended and not att.keys:
            self._finish(att)

    # --- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        # Announced while the model loads: a request sent meanwhile waits in Redis for
        # it (its queue timeout runs) instead of a 503 for a worker about to serve it.
        if self._start_online is not None:
            self.online = self._start_online(self)
        try:
            self.engine = self._load()
            self.prepare = preparer_for(self.engine)
        except Exception as exc:
            if isinstance(exc, ModelRefused):  # one line: the architecture and why
                log.error("model %s refused at load: %s", self.model, exc)
            else:
                log.exception("could not load %s", self.model)
            if self.online is not None:
                self.online.stop()
                self.online.leave()
            return
        finally:
            self.loaded.set()
        self._loop()

    def _loop(self) -> None:
        wire = Wire(self.engine)
        _Relay.to(self)
        # Online work only where the host has some: an engine that serves none (a test's
        # stand-in) need not take the argument.
        online = {} if self.online is None else {"online": self.online}
        while not self.stopping:
            try:
                results = self.engine.run(self._lines, cancelled=self._cancelled, **online)
                for result in results:
                    self._route(wire(result))
                return  # stopping: the source ended
            except Exception as exc:
                if self.online is not None or self.attached is None:
                    log.exception("engine loop of %s failed", self.model)
                # else the lease it fails raises it in its task, which says so
                self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        """The run ended with an error: what it held fails, and a new run starts."""
        att = self.attached
        if att is not None:
            error: BaseException = exc
            if is_out_of_memory(exc) and getattr(self.engine, "max_rows", 1) <= 1:
                error = RuntimeError(f"out of memory with one row: {exc!r}")
            self._finish(att, error)
        self._dropped.clear()  # a new run holds none of them
        if self.online is not None:
            self.online.fail_all(exc)
        rows = getattr(self.engine, "max_rows", 1)  # a test's stand-in may have none
        if is_out_of_memory(exc) and rows > 1:
            # The next run decodes fewer rows at once (runner.process resends the lease).
            self.engine.max_rows = max(1, rows // 2)
            log.warning("out of memory with %d rows; now %d", rows, self.engine.max_rows)

    def _route(self, result: GenResult) -> None:
        online = self.online
        if online is not None and online.owns(result.key):
            online.finished(result)
            return
        att = self.attached
        if att is None or result.key not in att.keys:
            return  # a line of a lease that left (its lines were given back)
        att.keys.discard(result.key)
        try:
            att.put(result)
        except Exception as exc:
            self._finish(att, exc)
            return
        self._check(att)

    def _cancelled(self) -> AbstractSet[Any]:
        """The engine's cancel hook, once a step: the lease's cancelled lines, the lines
        of a lease that left, online requests their clients gave up. A step begins."""
        for observer in self.observers:
            observer.step()
        out: set[Any] = set()
        att = self.attached
        if att is not None and att.cancelled is not None:
            try:
                keys = att.cancelled()
            except Exception as exc:
                self._finish(att, exc)
            else:
                if keys:
                    out |= keys
                    att.keys -= keys
                    self._check(att)
        if self._dropped:
            out |= self._dropped
            self._dropped = set()
        if self.online is not None:
            out |= self.online.cancelled()
        return out


class _Lines:
    """The loop's request source: the attached lease's lines, WAKE when an online request
    came while it waited for input, the end when the host stops."""

    def __init__(self, host: EngineHost, orders_ahead: bool) -> None:
        self.host = host
        # A lease process orders its window (scheduling/intake.py reads it a little ahead).
        self.orders_ahead = orders_ahead

    def ready(self) -> int:
        att = self.host.attached
        if att is None or att.ended:
            return 0
        try:
            return att.ready()
        except Exception as exc:
            self.host._finish(att, exc)
            return 0

    def __iter__(self) -> Iterator[Line | Wake]:
        return self

    def __next__(self) -> Line | Wake:
        host = self.host
        att = host.attached
        if att is not None and not att.ended:
            try:
                req = next(att.it)
            except StopIteration:
                att.ended = True
                host._check(att)
                return WAKE
            except Exception as exc:
                host._finish(att, exc)
                return WAKE
            att.keys.add(req.key)
            return req
        if att is not None:
            # Asked to wait with no row running and nothing waiting: all of the lease's
            # lines came back (a lost one would otherwise hold its task forever).
            if att.keys:
                log.warning("lease of %s left %d lines unanswered", host.model, len(att.keys))
            host._finish(att)
        online = host.online
        with host._cond:
            while True:
                if online is not None and online.waiting():
                    return WAKE
                if host.attached is not None:
                    return WAKE  # a lease came: the engine asks again
                if host.stopping:
                    raise StopIteration
                host._cond.wait()


# Hosts of engines loaded outside a worker's served hosts, by engine (`local`): the
# engine itself beside its host (which holds it only once its thread loaded it).
_local: dict[int, tuple[Any, EngineHost]] = {}
_in_use: dict[EngineHost, int] = {}
_local_lock = threading.Lock()


@contextmanager
def local(model: str, engine: Any, *, orders_ahead: bool) -> Iterator[EngineHost]:
    """The host of `engine`, loaded in this process: started (a thread, no online work) at
    first use and kept for the next lease. Idle hosts of the model's other engines (a
    test's earlier stand-ins) stop."""
    with _local_lock:
        held = _local.pop(id(engine), None)
        if held is not None and held[0] is engine and held[1].orders_ahead == orders_ahead:
            host = held[1]
        else:
            if held is not None and not _in_use.get(held[1]):
                held[1].stop(timeout=10)
            host = EngineHost(model, lambda: engine, orders_ahead=orders_ahead)
            host.start()
        for key, (_, other) in list(_local.items()):
            if other.model == model and not _in_use.get(other):
                del _local[key]
                other.stop(timeout=10)  # idle: its run ends at once
        _local[id(engine)] = (engine, host)
        _in_use[host] = _in_use.get(host, 0) + 1
    try:
        host.loaded.wait()
        yield host
    finally:
        with _local_lock:
            _in_use[host] -= 1
            if not _in_use[host]:
                del _in_use[host]
                if _local.get(id(engine), (None, None))[1] is not host:
                    host.stop(timeout=10)  # replaced while it ran a lease


def stop_local() -> None:
    """Stop the hosts `local` started (idle ones: their engines' runs end), so that a
    caller may run those engines itself with the device state they keep (a bench's engine
    alone beside its service path)."""
    with _local_lock:
        hosts = [host for _, host in _local.values() if not _in_use.get(host)]
        for key in [k for k, (_, host) in _local.items() if host in hosts]:
            del _local[key]
    for host in hosts:
        host.stop()
