"""The lane: online requests in the engine, admitted at the next step, ahead of every batch
line.

`Engine.run(requests, online=feed)`: at each step the scheduler takes the online
requests that arrived (`feed.take()`) and admits them before any waiting batch line, in
the order they came. When the rows or the KV budget are full of batch rows, batch lines
give theirs up, the youngest first (preempt.py); online requests never take rows
from each other (one that does not fit waits for online rows to end, and batch lines
wait behind it). A model's `online_rows` (registry) keeps that many rows free of batch
lines.

A streamed request (`EngineRequest.stream`) gets one `feed.emit(key, deltas)` per step
whose tokens gave its choices something (output/processor.py), before the step's results
are yielded. Online results come out of `run` like any other; which keys are online is
the caller's to know.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Set
from concurrent import futures
from typing import Any, Protocol

from batchwright.engine.requests.feed import LaneFeed
from batchwright.engine.requests.jobs import Job, Unit, bad_request, server_error, units_of
from batchwright.engine.requests.request import EngineRequest
from batchwright.engine.requests.types import GenResult
from batchwright.engine.sampling.grammar import grammar_error
from batchwright.engine.scheduling import preempt
from batchwright.engine.scheduling.intake import (
    Intake,
    Scoring,
    Start,
    adapter_error,
    adapter_refusal,
    too_big,
)
from batchwright.engine.scheduling.rows import Rows

log = logging.getLogger(__name__)
# With nothing else to do, how long a step waits for a grammar being compiled (cancels and
# new requests are looked at in between).
_GRAMMAR_WAIT = 0.05


class Streams(Protocol):
    """Where a streamed request's deltas are kept (output/processor.py)."""

    def open(self, job: Job, stream: bool) -> None: ...

    def flush(self, job: Job) -> None: ...

    def admitted(self, key: Any) -> None:
        """The request has rows: its stream may show (what refuses a request, its
        grammar or the KV budget, does so before its first delta)."""
        ...

    def close(self, keys: Set[Any]) -> None: ...


class Lane:
    """The online requests of one run: waiting (in arrival order) and streaming."""

    def __init__(
        self,
        rows: Rows,
        intake: Intake,
        feed: LaneFeed | None,
        streams: Streams,
        *,
        start: Start,
        reserve: int,
        max_batch_tokens: int,
    ) -> None:
        self.rows = rows
        self.intake = intake
        self.feed = feed
        self.streams = streams
        self.start = start
        self.max_batch_tokens = max_batch_tokens
        self.waiting: list[Unit] = []
        self.reserve = max(0, min(reserve, rows.max_rows - 1))
        self._round = 0

    # --- admission ---------------------------------------------------------------------

    def admit(self) -> Generator[GenResult | Scoring, None, list[Unit]]:
        """Online units for this step (batch rows preempted as needed); yields results
        of online requests that end without a row (errors, echo scoring only), and a
        `Scoring` for each request taken whose prompts need echo scores (intake.py)."""
        self._round += 1
        if self.feed is None:
            return []
        for request in self.feed.take():
            yield from self._take(request)
        units: list[Unit] = []
        rows = blocks = tokens = 0
        s = self.rows
        kv = s.kv
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
            # Its adapter's weights are read off the loop (the requests behind it go
            # first), and it needs a slot for them (engine/lora/run.py): without one it
            # waits, and the batch lines behind it with it.
            weights = unit.job.lora
            if weights is not None and not weights.done():
                at += 1
                continue
            if (why := adapter_error(weights)) is not None:
                self.drop({unit.job.key})
                yield bad_request(unit.job.key, why, "model", "model_not_found")
                continue
            lora = s.lora
            if lora is not None and not lora.gate(unit):
                break
            if self._too_big(unit):
                yield self._reject(unit)
                continue
            if units and tokens + len(unit.prompt) > self.max_batch_tokens:
                break
            # A plain cost (no prefix reuse counted) is an upper bound: preemption may free
            # a little more than needed, never less.
            while (
                len(unit.seqs) > s.free - rows or kv.cost(unit) > kv.free - blocks
            ) and self._preempt():
                pass
            take = min(len(unit.seqs), s.free - rows)
            while take > 0 and kv.cost(_first(unit, take)) > kv.free - blocks:
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
            blocks += kv.cost(unit)
            tokens += len(unit.prompt)
            units.append(unit)
            self.streams.admitted(unit.job.key)
        if not units and self.waiting and not s.live and not self.intake.pending:
            # Nothing runs and what waits waits for its grammar or its adapter's weights:
            # a short wait, not a spin.
            pending = [[f for f in (u.job.grammar, u.job.lora) if f is not None and not f.done()]
                       for u in self.waiting]  # fmt: skip
            if all(pending):
                futures.wait(
                    [f for fs in pending for f in fs], _GRAMMAR_WAIT, futures.FIRST_COMPLETED
                )
        return units

    def batch_rows(self, online_admitted: bool) -> int:
        """Rows batch lines may take this step: none while an online request waits or
        was just admitted (the step's prompt budget is its), else the free rows less the
        reserve for online requests. One whose grammar still compiles holds none back."""
        if online_admitted or any(_ready(u) for u in self.waiting):
            return 0
        s = self.rows
        free = s.free
        if self.reserve:
            batch = sum(1 for q in s.seqs if q is not None and not q.job.online)
            free = min(free, s.max_rows - self.reserve - batch)
        return max(0, free)

    def started(self, units: list[Unit]) -> None:
        """Batch units admitted this step: the youngest, for preemption."""
        for u in units:
            u.job.admitted = self._round

    def _preempt(self) -> bool:
        job = preempt.youngest(self.rows.seqs)
        if job is None:
            return False
        rows = preempt.preempt(self.rows, self.intake, job)
        if self.feed is not None:
            self.feed.preempted(1, rows)
        return True

    def _take(
        self, request: EngineRequest | GenResult
    ) -> Generator[GenResult | Scoring, None, None]:
        """The request's job, waiting for rows; its refusals (and a failure of its own,
        a 500 for it alone) come out as results before its Started."""
        if isinstance(request, GenResult):  # refused when it was prepared
            yield request
            return
        try:
            job = self.start(request)
        except Exception as exc:
            log.exception("online request %s: starting it failed", request.key)
            yield server_error(request.key, exc)
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
                yield Scoring(job)  # scored by the runner before this resumes
        except Exception as exc:
            log.exception("online request %s: scoring its prompt failed", request.key)
            yield server_error(request.key, exc)
            return
        self.streams.open(job, request.stream)
        if job.done:  # nothing to generate (max_tokens 0)
            self.streams.flush(job)
            yield job.result()
            return
        self.waiting += units_of(job)

    def _too_big(self, unit: Unit) -> bool:
        """One candidate of it needs more KV blocks than the whole cache has."""
        kv = self.rows.kv
        return kv.cost(_first(unit)) > kv.usable

    def _reject(self, unit: Unit) -> GenResult:
        self.drop({unit.job.key})
        return too_big(unit.job.key, self.rows.kv.capacity_tokens)

    def drop(self, keys: Set[Any]) -> None:
        """Requests cancelled: their waiting units and streams go (rows: the runner)."""
        self.waiting = [u for u in self.waiting if u.job.key not in keys]
        self.streams.close(keys)


def _ready(unit: Unit) -> bool:
    """Not waiting for a grammar: compiled (or failed: it is answered at the next admit),
    or none."""
    g = unit.job.grammar
    return g is None or g.done()


def _first(unit: Unit, k: int = 1) -> Unit:
    """The unit's first `k` candidates (admitted before the others when rows are short)."""
    return unit if k >= len(unit.seqs) else Unit(unit.job, unit.prompt_index, unit.seqs[:k])
