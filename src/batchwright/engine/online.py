"""Online requests in the engine: admitted at the next step, ahead of every batch line.

`Engine.run(requests, online=feed)`: at each step the scheduler takes the online
requests that arrived (`feed.take()`) and admits them before any waiting batch line, in
the order they came. When the rows or the KV budget are full of batch rows, batch lines
give theirs up, the youngest first (engine/preempt.py); online requests never take rows
from each other (one that does not fit waits for online rows to end, and batch lines
wait behind it). A model's `online_rows` (registry) keeps that many rows free of batch
lines.

Each step, every streamed request (`GenRequest.stream`) whose choices gained something
gets one `feed.emit(key, deltas)` (engine/streaming.py), before the step's results are
yielded: a request's last delta always comes before its result. Online results come out
of `run` like any other; which keys are online is the caller's to know.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Set
from concurrent import futures
from typing import Any, Protocol

from batchwright.engine import preempt
from batchwright.engine.grammar import grammar_error
from batchwright.engine.intake import Intake, Unit, adapter_error, adapter_refusal, units_of
from batchwright.engine.jobs import bad_request, server_error
from batchwright.engine.lora.run import LoraRun
from batchwright.engine.paged import PagedCache
from batchwright.engine.parts import Parts
from batchwright.engine.sampler import Sampler
from batchwright.engine.slots import Slots
from batchwright.engine.streaming import Delta, JobStream
from batchwright.engine.types import GenRequest, GenResult

log = logging.getLogger(__name__)
# With nothing else to do, how long a step waits for a grammar being compiled (cancels and
# new requests are looked at in between).
_GRAMMAR_WAIT = 0.05


class OnlineFeed(Protocol):
    def take(self) -> list[GenRequest]:
        """Online requests that arrived since the last call (never waits)."""
        ...

    def started(self, key: Any, prompt_tokens: int) -> None:
        """The engine has the request (it passed the model's checks)."""
        ...

    def emit(self, key: Any, deltas: list[Delta]) -> None:
        """What the choices of a streamed request gained in one step."""
        ...

    def preempted(self, lines: int, rows: int) -> None:
        """Batch lines (and their rows) that gave their rows to online requests."""
        ...

    def rows(self, online: int) -> None:
        """Rows online requests hold after a step."""
        ...


class Loop(Protocol):
    """What a lane uses of the batching loop (the scheduler is one)."""

    e: Parts
    cache: PagedCache
    slots: Slots
    sampler: Sampler
    lora: LoraRun | None

    def kv_cost(self, unit: Unit) -> int: ...


class Lane:
    """The online requests of one run: waiting (in arrival order) and streaming."""

    def __init__(self, sched: Loop, intake: Intake, feed: OnlineFeed | None) -> None:
        self.s = sched
        self.intake = intake
        self.feed = feed
        self.waiting: list[Unit] = []
        self.streams: dict[Any, JobStream] = {}
        # Requests with rows: only they stream, so that whatever refuses a request
        # (its grammar, the KV budget) does so before its first delta.
        self.running: set[Any] = set()
        rows = sched.e.max_rows
        self.reserve = max(0, min(sched.e.spec.online_rows, rows - 1))
        self._round = 0

    # --- admission ---------------------------------------------------------------------

    def admit(self) -> Generator[GenResult, None, list[Unit]]:
        """Online units for this step (batch rows preempted as needed); yields results
        of online requests that end without a row (errors, echo scoring only)."""
        self._round += 1
        if self.feed is None:
            return []
        for greq in self.feed.take():
            yield from self._prepare(greq)
        units: list[Unit] = []
        rows = blocks = tokens = 0
        s = self.s
        alloc = s.cache.alloc
        at = 0
        while at < len(self.waiting):
            unit = self.waiting[at]
            grammar = unit.job.grammar
            if grammar is not None and not grammar.done():
                at += 1  # compiles off the loop: the requests behind it go first
                continue
            if grammar is not None and (why := grammar_error(grammar)) is not None:
                self.drop({unit.job.key})
                yield bad_request(unit.job.key, why, "response_format", "invalid_response_format")
                continue
            # Its adapter's weights are read off the loop, and it needs a slot for them
            # (engine/lora/run.py): it waits, and the batch lines behind it with it.
            weights = unit.job.lora
            if weights is not None and not weights.done():
                break
            if (why := adapter_error(weights)) is not None:
                self.drop({unit.job.key})
                yield bad_request(unit.job.key, why, "model", "model_not_found")
                continue
            lora = s.lora
            if lora is not None and not lora.gate(unit):
                break
            if s.kv_cost(_first(unit)) > alloc.num_blocks - 1:
                yield self._reject(unit)
                continue
            if units and tokens + len(unit.prompt) > s.e.max_batch_tokens:
                break
            # A plain cost (no prefix reuse counted) is an upper bound: preemption may free
            # a little more than needed, never less.
            while (
                len(unit.seqs) > s.slots.free_count - rows or s.kv_cost(unit) > alloc.free - blocks
            ) and self._preempt():
                pass
            take = min(len(unit.seqs), s.slots.free_count - rows)
            while take > 0 and s.kv_cost(_first(unit, take)) > alloc.free - blocks:
                take -= 1
            if take == 0:
                break  # online rows hold what it needs: it waits for them
            if take < len(unit.seqs):
                rest = unit.seqs[take:]
                unit = _first(unit, take)
                self.waiting[at].seqs = rest  # the others wait for rows
            else:
                del self.waiting[at]
            rows += take
            blocks += s.kv_cost(unit)
            tokens += len(unit.prompt)
            units.append(unit)
            if unit.job.key in self.streams:
                self.running.add(unit.job.key)
        if not units and self.waiting and not s.slots.live and not self.intake.pending:
            # Nothing runs and what waits waits for its grammar: a short wait, not a spin.
            compiling = [u.job.grammar for u in self.waiting if u.job.grammar is not None]
            if len(compiling) == len(self.waiting):
                futures.wait(compiling, _GRAMMAR_WAIT, futures.FIRST_COMPLETED)
        return units

    def batch_rows(self, online_admitted: bool) -> int:
        """Rows batch lines may take this step: none while an online request waits or
        was just admitted (the step's prompt budget is its), else the free rows less the
        reserve for online requests. One whose grammar still compiles holds none back."""
        if online_admitted or any(_ready(u) for u in self.waiting):
            return 0
        s = self.s.slots
        free = s.free_count
        if self.reserve:
            batch = sum(1 for q in s.seqs if q is not None and not q.job.online)
            free = min(free, s.max_rows - self.reserve - batch)
        return max(0, free)

    def started(self, units: list[Unit]) -> None:
        """Batch units admitted this step: the youngest, for preemption."""
        for u in units:
            u.job.admitted = self._round

    def _preempt(self) -> bool:
        job = preempt.youngest(self.s.slots)
        if job is None:
            return False
        rows = preempt.preempt(self.s.slots, self.s.sampler, self.intake, job)
        if self.feed is not None:
            self.feed.preempted(1, rows)
        return True

    def _prepare(self, greq: GenRequest) -> Generator[GenResult, None, None]:
        """The request's job, waiting for rows; its refusals (and a failure of its own,
        a 500 for it alone) come out as results before its Started."""
        e = self.s.e
        try:
            job = e.prepare(greq)
        except Exception as exc:
            log.exception("online request %s: prepare failed", greq.key)
            yield server_error(greq.key, exc)
            return
        if isinstance(job, GenResult):
            yield job
            return
        job.online = True
        too_big = next((u for u in units_of(job) if self._too_big(u)), None)
        if too_big is not None:
            yield self._reject(too_big)
            return
        if (refused := adapter_refusal(job)) is not None:
            yield refused
            return
        if self.feed is not None:
            self.feed.started(job.key, sum(len(p) for p in job.prompts))
        try:
            if job.needs_prompt_scores:
                k = job.req.logprobs or 0
                job.prompt_scores = {
                    i: e.score_prompt(p, k, job.adapter) for i, p in enumerate(job.prompts)
                }
        except Exception as exc:
            log.exception("online request %s: scoring its prompt failed", greq.key)
            yield server_error(greq.key, exc)
            return
        stream = JobStream(e, job) if greq.stream and JobStream.streams(job) else None
        if job.done:  # nothing to generate (max_tokens 0)
            if stream is not None and self.feed is not None:
                self.feed.emit(job.key, stream.deltas())
            yield e.result(job)
            return
        if stream is not None:
            self.streams[job.key] = stream
        self.waiting += units_of(job)

    def _too_big(self, unit: Unit) -> bool:
        """One candidate of it needs more KV blocks than the whole cache has."""
        return self.s.kv_cost(_first(unit)) > self.s.cache.alloc.num_blocks - 1

    def _reject(self, unit: Unit) -> GenResult:
        cache = self.s.cache
        tokens = (cache.alloc.num_blocks - 1) * cache.block_size
        self.drop({unit.job.key})
        return bad_request(
            unit.job.key,
            f"This request needs more KV-cache memory than the model's worker has "
            f"({tokens} tokens); reduce n, best_of or max_tokens.",
            "max_tokens",
            "context_length_exceeded",
        )

    # --- the rest of a request's life --------------------------------------------------

    def emit(self) -> None:
        """One delta per streamed request that gained something this step."""
        if self.feed is None:
            return
        seqs = self.s.slots.seqs
        self.feed.rows(sum(1 for q in seqs if q is not None and q.job.online))
        for key, stream in list(self.streams.items()):
            if key not in self.running:
                continue  # no row yet: nothing is shown before its last refusal could come
            deltas = stream.deltas()
            if deltas:
                self.feed.emit(key, deltas)
            if stream.finished:
                del self.streams[key]
                self.running.discard(key)

    def drop(self, keys: Set[Any]) -> None:
        """Requests cancelled: their waiting units and streams go (rows: the scheduler)."""
        self.waiting = [u for u in self.waiting if u.job.key not in keys]
        for key in keys & self.streams.keys():
            del self.streams[key]
        self.running -= keys


def _ready(unit: Unit) -> bool:
    """Not waiting for a grammar: compiled (or failed: it is answered at the next admit),
    or none."""
    g = unit.job.grammar
    return g is None or g.done()


def _first(unit: Unit, k: int = 1) -> Unit:
    """The unit's first `k` candidates (admitted before the others when rows are short)."""
    return unit if k >= len(unit.seqs) else Unit(unit.job, unit.prompt_index, unit.seqs[:k])
