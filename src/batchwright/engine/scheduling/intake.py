"""Requests waiting for a row: read a bounded window ahead, admitted longest first.

A source that says how many requests it holds ready (`ready()`, as the worker's claim
read-ahead does) is topped up every step with what is ready, never waited for while rows
run: the loop does not stall on a claim, and a request claimed now is in the window at the
next step. Any other iterable is read a window at a time. Among waiting requests of
several groups (`GenRequest.group`: the worker's batches), the group with the fewest
running rows goes first, so a small batch claimed behind a big one starts at the next
free rows instead of behind the whole window.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Generator, Hashable, Iterable, Set
from concurrent import futures
from dataclasses import dataclass
from typing import Any

from batchwright.engine.requests.jobs import (
    Job,
    Unit,
    bad_request,
    server_error,
    units_of,
)
from batchwright.engine.requests.request import EngineRequest
from batchwright.engine.requests.types import GenResult, Wake
from batchwright.engine.sampling.grammar import grammar_error

log = logging.getLogger(__name__)

# What the engine's sources yield: requests, results of lines refused before the engine
# (in their place among the lines), and WAKE.
Item = EngineRequest | GenResult | Wake
# A validated request's job (requests/jobs.py's `start`, bound to the model).
Start = Callable[[EngineRequest], Job]


@dataclass(frozen=True)
class Scoring:
    """A job whose prompts need their echo scores (echo with logprobs) before it goes on.

    Admission yields it as it reads the request; the engine's loop has the model runner
    compute the scores (`job.prompt_scores`) and resumes admission at once, or throws what
    failed back in at the yield (that request's 500 alone). So the scheduler does no
    tensor work, and the scores come before anything else of the request happens: its
    result (scoring only) or its rows."""

    job: Job


# Requests read ahead, in multiples of max_rows: longest-first admission needs a window
# wider than the batch to keep the end of a file from draining on a few long rows
# (measured on bench/engine_bench.py: 297 decode steps with 1, 280 with 2, 282 with 4).
_LOOKAHEAD = 2
# A source that orders its own window of ready requests (`orders_ahead`: the worker's lease
# process, which puts a newcomer batch's lines first) is read only half a batch ahead, so
# lines wait there rather than behind two batches' worth here (bench/fair_share.py: the
# small batch 0.13-0.20 s under load against 0.20-0.22 s; the same decode steps).
_LOOKAHEAD_ORDERED = 0.5


def _order(unit: Unit) -> tuple[bool, int]:
    # Preempted lines first (preempt.py), then the longest generations.
    return not unit.job.requeued, -unit.job.req.max_tokens


class Intake:
    def __init__(
        self,
        requests: Iterable[Item],
        *,
        max_rows: int,
        max_batch_tokens: int,
        start: Start,
    ) -> None:
        self.max_rows = max_rows
        self.max_batch_tokens = max_batch_tokens
        self.start = start
        self.it = iter(requests)
        self._ready: Callable[[], int] | None = getattr(requests, "ready", None)
        ordered = getattr(requests, "orders_ahead", False)
        self._window = max(1, int(max_rows * (_LOOKAHEAD_ORDERED if ordered else _LOOKAHEAD)))
        self.pending: list[Unit] = []  # longest generation first
        self._groups: Counter[Hashable] = Counter()  # waiting units per group
        self.exhausted = False

    @property
    def drained(self) -> bool:
        return self.exhausted and not self.pending

    def admit(
        self,
        free: int,
        *,
        packed: bool,
        kv_free: int | None = None,
        kv_cost: Callable[[Unit], int] | None = None,
        prompt_cost: Callable[[Unit], int] | None = None,
        running: Callable[[], Counter[Hashable]] | None = None,
        idle: bool = True,
        gate: Callable[[Unit], bool] | None = None,
    ) -> Generator[GenResult | Scoring, None, list[Unit]]:
        """Units for up to `free` rows within max_batch_tokens of prompt tokens (padded
        tokens when not `packed`; a lone longer prompt still goes) and within `kv_free`
        cache blocks (`kv_cost` of a unit). `prompt_cost` (packed only) is the tokens a
        unit's prefill computes when not all of them (a cached prefix); it is called once
        per unit considered, in order. Yields the results of requests that finish without
        generating (errors, scoring only), and a `Scoring` for each request read whose
        prompts need echo scores. `running`: rows running per group. A source
        with `ready()` is waited on only when `idle` (no rows running) and nothing else
        can be admitted. `gate`: whether a ready unit may go now (its LoRA adapter has a
        slot, engine/lora/run.py; it takes the slot when it says yes); a unit it holds
        back waits without holding the others."""
        units: list[Unit] = []
        width = tokens = 0
        if self._ready is not None and not self.exhausted:
            yield from self._read(wait=False)
        counts: Counter[Hashable] | None = None
        yield from self._grammar_failures()
        while free > 0:
            if not self.pending:
                if self.exhausted:
                    break
                wait = self._ready is None or (idle and not units)
                woke = yield from self._read(wait=wait)
                if (woke or not wait) and not self.pending:
                    break  # nothing ready: the rows running go on without it
                continue
            at = 0
            if running is not None:
                at, counts = self._next(running, counts)
            if not (_ready(self.pending[at]) and (gate is None or gate(self.pending[at]))):
                if any(_failed(u) for u in self.pending):
                    yield from self._grammar_failures()
                    continue
                # A line waits for its grammar (grammar.py) or its adapter's weights and
                # slot (engine/lora/) without holding the others.
                at = next(
                    (
                        i
                        for i, u in enumerate(self.pending)
                        if _ready(u) and (gate is None or gate(u))
                    ),
                    -1,
                )
                if at < 0:
                    if units or not idle or not self._waiting_on():
                        break
                    yield from self._wait_grammar()
                    continue
            unit = self.pending[at]
            w = max(width, len(unit.prompt))
            new = len(unit.prompt) if prompt_cost is None else prompt_cost(unit)
            cost = tokens + new if packed else w * (len(units) + 1)
            if units and cost > self.max_batch_tokens:
                break
            if len(unit.seqs) > free:
                unit = Unit(unit.job, unit.prompt_index, unit.seqs[:free])
            if kv_cost is not None and kv_free is not None:
                blocks = kv_cost(unit)
                if blocks > kv_free:
                    break  # admitted once running rows release theirs
                kv_free -= blocks
            tokens += new
            head = self.pending[at]
            if unit is not head:
                head.seqs = head.seqs[len(unit.seqs) :]
            else:
                del self.pending[at]
                self._forget([unit])
            if counts is not None:
                counts[unit.job.group] += len(unit.seqs)
            units.append(unit)
            free -= len(unit.seqs)
            width = w
        return units

    def _next(
        self, running: Callable[[], Counter[Hashable]], counts: Counter[Hashable] | None
    ) -> tuple[int, Counter[Hashable] | None]:
        """Index of the next unit: the first (longest) of the group with the fewest rows
        running; the head when only one group waits (rows are then not counted). Returns
        the running counts too, taken once per admission round."""
        if len(self._groups) == 1:
            return 0, counts
        first: dict[Hashable, int] = {}
        for i, u in enumerate(self.pending):
            first.setdefault(u.job.group, i)
        rows = running() if counts is None else counts
        return min(first.items(), key=lambda gi: (rows[gi[0]], gi[1]))[1], rows

    def _grammar_failures(self) -> Generator[GenResult, None, None]:
        """A 400 for each waiting request whose response_format failed to compile."""
        failed: dict[Any, tuple[str, str, str]] = {}
        for u in self.pending:
            if not _failed(u):
                continue
            if (why := adapter_error(u.job.lora)) is not None:
                failed[u.job.key] = (why, "model", "model_not_found")
            elif (why := grammar_error(u.job.grammar)) is not None:
                failed[u.job.key] = (why, "response_format", "invalid_response_format")
        if failed:
            self.drop(set(failed))
            for key, (why, param, code) in failed.items():
                yield bad_request(key, why, param, code)

    def _waiting_on(self) -> list[Any]:
        """Futures (grammars, adapter weights) that waiting lines wait for."""
        return [
            f
            for u in self.pending
            for f in (u.job.grammar, u.job.lora)
            if f is not None and not f.done()
        ]

    def _wait_grammar(self) -> Generator[GenResult, None, None]:
        """Nothing runs and every waiting line waits for a grammar or an adapter's
        weights: wait for one."""
        futures.wait(self._waiting_on(), return_when=futures.FIRST_COMPLETED)
        yield from self._grammar_failures()

    def drop(self, keys: Set[Any]) -> None:
        """Forget waiting candidates of requests in `keys` (cancelled: no result)."""
        self._forget([u for u in self.pending if u.job.key in keys])
        self.pending = [u for u in self.pending if u.job.key not in keys]

    def requeue(self, job: Job) -> None:
        """`job` waits again, ahead of the lines that never ran (engine/scheduling/preempt.py)."""
        units = units_of(job)
        self.pending[:0] = units
        self._groups.update(u.job.group for u in units)
        self.pending.sort(key=_order)  # stable

    def _forget(self, units: list[Unit]) -> None:
        self._groups.subtract(u.job.group for u in units)
        self._groups += Counter()  # drops groups with none left

    def reject_head(self, tokens: int) -> GenResult:
        """The first waiting request cannot fit even in an empty cache of `tokens` tokens:
        a 400 for it, and its other waiting candidates go too."""
        job = self.pending[0].job
        self.drop({job.key})
        return too_big(job.key, tokens)

    def _read(self, *, wait: bool) -> Generator[GenResult | Scoring, None, bool]:
        """Read requests into `pending` up to the window, longest generation first: from
        a source with `ready()` what it holds ready (waiting for up to max_rows when
        `wait`), from any other a whole window. Returns True when the source ended the
        wait with WAKE (requests/types.py).

        Admitting long generations first leaves the short ones for the end of the input, so
        the batch stays full until close to the end instead of draining on a few long rows.
        The window is a fixed multiple of max_rows, so memory stays bounded by configuration.
        """
        room = self._window - len(self.pending)
        if self._ready is not None:
            # With nothing running, wait for a batch's worth (or the end of the input):
            # starting on the first request alone would only fill the rows a few at a time.
            room = min(room, max(self.max_rows if wait else 0, self._ready()))
        units: list[Unit] = []
        woke = False
        for _ in range(room):
            item = next(self.it, None)
            if item is None:
                self.exhausted = True
                break
            if isinstance(item, Wake):
                woke = True
                break
            if isinstance(item, GenResult):  # refused when it was prepared
                yield item
                continue
            refused: GenResult | None = None
            try:
                job = self.start(item)
                refused = adapter_refusal(job)
                if refused is None and job.needs_prompt_scores:
                    yield Scoring(job)  # scored by the runner before this resumes
            except Exception as exc:
                # This line's failure, not the run's: the other lines and online requests
                # go on (a raise here ended the engine's run and failed them all).
                log.exception("line %s: starting it failed", item.key)
                yield server_error(item.key, exc)
                continue
            if refused is not None:
                yield refused
                continue
            if job.done:
                yield job.result()
                continue
            units += units_of(job)
        if units:
            self.pending.extend(units)
            self._groups.update(u.job.group for u in units)
            self.pending.sort(key=_order)  # stable
        return woke


def _ready(unit: Unit) -> bool:
    """Whether the unit's grammar and adapter weights, if it has them, are ready."""
    job = unit.job
    if job.grammar is None and job.lora is None:
        return True
    return all(f is None or (f.done() and f.exception() is None) for f in _futures(unit))


def _failed(unit: Unit) -> bool:
    # Every waiting unit is asked every step: most have neither future, so say so first
    # (the generator below cost 1-1.5 % of the CPU bench's run).
    job = unit.job
    if job.grammar is None and job.lora is None:
        return False
    return any(f is not None and f.done() and f.exception() is not None for f in _futures(unit))


def _futures(unit: Unit) -> tuple[Any, Any]:
    return unit.job.grammar, unit.job.lora


def too_big(key: Any, tokens: int) -> GenResult:
    """The 400 of a request one of whose candidates needs more KV blocks than the whole
    cache (`tokens` tokens) has: a batch line here, an online request in lane.py."""
    return bad_request(
        key,
        f"This request needs more KV-cache memory than the model's worker has "
        f"({tokens} tokens); reduce n, best_of or max_tokens.",
        "max_tokens",
        "context_length_exceeded",
    )


def adapter_refusal(job: Job) -> GenResult | None:
    """A job that runs on the host now (echo scoring, or nothing to generate) needs its
    adapter's weights at once: it waits for them here, and is refused if they fail."""
    if job.lora is None or not (job.needs_prompt_scores or job.done):
        return None
    futures.wait([job.lora])
    why = adapter_error(job.lora)
    return None if why is None else bad_request(job.key, why, "model", "model_not_found")


def adapter_error(future: Any) -> str | None:
    """Why the adapter's weights could not be had (its Future failed), or None."""
    if future is None or not future.done():
        return None
    exc = future.exception() if not future.cancelled() else None
    return None if exc is None else str(exc)
