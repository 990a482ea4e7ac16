"""Requests waiting for a row: read a bounded window ahead, admitted longest first."""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchwright.engine.jobs import Job, Seq
from batchwright.engine.types import GenRequest, GenResult

if TYPE_CHECKING:
    from batchwright.engine.runtime import Engine

# Requests read ahead, in multiples of max_rows: longest-first admission needs a window
# wider than the batch to keep the end of a file from draining on a few long rows
# (measured on bench/engine_bench.py: 297 decode steps with 1, 280 with 2, 282 with 4).
_LOOKAHEAD = 2


@dataclass(eq=False)
class Unit:
    """Candidates of one prompt admitted together: the prompt is prefilled once for all."""

    job: Job
    prompt_index: int
    seqs: list[Seq]

    @property
    def prompt(self) -> list[int]:
        return self.job.prompts[self.prompt_index]


class Intake:
    def __init__(self, engine: Engine, requests: Iterable[GenRequest]) -> None:
        self.e = engine
        self.it = iter(requests)
        self.pending: deque[Unit] = deque()
        self.exhausted = False

    @property
    def drained(self) -> bool:
        return self.exhausted and not self.pending

    def drop(self, keys: AbstractSet[Any]) -> None:
        """Forget the waiting candidates of cancelled requests."""
        if self.pending:
            self.pending = deque(u for u in self.pending if u.job.key not in keys)

    def admit(self, free: int, *, packed: bool) -> Generator[GenResult, None, list[Unit]]:
        """Units for up to `free` rows within max_batch_tokens of prompt tokens (padded
        tokens when not `packed`; a lone longer prompt still goes). Yields the results of
        requests that finish without generating (errors, scoring only)."""
        units: list[Unit] = []
        width = tokens = 0
        while free > 0:
            if not self.pending:
                if self.exhausted:
                    break
                yield from self._read()
                continue
            unit = self.pending[0]
            w = max(width, len(unit.prompt))
            cost = tokens + len(unit.prompt) if packed else w * (len(units) + 1)
            if units and cost > self.e.max_batch_tokens:
                break
            tokens += len(unit.prompt)
            if len(unit.seqs) > free:
                units.append(Unit(unit.job, unit.prompt_index, unit.seqs[:free]))
                unit.seqs = unit.seqs[free:]
            else:
                units.append(self.pending.popleft())
            free -= len(units[-1].seqs)
            width = w
        return units

    def _read(self) -> Generator[GenResult, None, None]:
        """Read a window of requests into `pending`, longest generation first.

        Admitting long generations first leaves the short ones for the end of the input, so
        the batch stays full until close to the end instead of draining on a few long rows.
        The window is a fixed multiple of max_rows, so memory stays bounded by configuration.
        """
        units: list[Unit] = []
        for _ in range(self.e.max_rows * _LOOKAHEAD):
            greq = next(self.it, None)
            if greq is None:
                self.exhausted = True
                break
            job = self.e.prepare(greq)
            if isinstance(job, GenResult):
                yield job
                continue
            if job.needs_prompt_scores:
                k = job.req.logprobs or 0
                job.prompt_scores = {
                    i: self.e.score_prompt(p, k) for i, p in enumerate(job.prompts)
                }
            if job.done:
                yield self.e.result(job)
                continue
            for p in range(len(job.prompts)):
                seqs = [s for s in job.seqs if s.prompt_index == p]
                units.append(Unit(job, p, seqs))
        units.sort(key=lambda u: -u.job.req.max_tokens)
        self.pending.extend(units)
