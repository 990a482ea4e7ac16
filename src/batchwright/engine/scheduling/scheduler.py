"""The scheduler: what the next step runs, as a plan; no tensors, no model.

Each step it admits online requests first (lane.py: preempting batch rows when rows or KV
blocks are short), then waiting batch lines into the rows and blocks left (intake.py:
longest generation first, the group with the fewest rows first, within the step's prompt
budget and the free blocks the KV manager counts, cached prefixes not counted). The plan
says which units (a prompt and its candidates) the step prefills beside the rows already
running, and whether rows should first move into holes (nothing waits, fewer rows would
run) or the first waiting request cannot fit even in an empty cache.

Results that need no step (requests refused when prepared, a compile that failed, echo
scoring only, a request too big for the cache) come out of `plan` and `reject_head`. So
does a `Scoring` for each request whose prompts need echo scores (echo with logprobs):
the engine's loop has the model runner compute them and resumes the plan (intake.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator, Hashable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from batchwright.engine.requests.feed import LaneFeed
from batchwright.engine.requests.jobs import Unit
from batchwright.engine.requests.types import GenResult
from batchwright.engine.scheduling.intake import Intake, Item, Scoring, Start
from batchwright.engine.scheduling.lane import Lane, Streams
from batchwright.engine.scheduling.rows import Rows


@dataclass
class Plan:
    """One step: the units it prefills (beside every running row's decode)."""

    units: list[Unit] = field(default_factory=list)
    compact: bool = False  # move rows into holes first: nothing to admit, nothing waits
    stuck: bool = False  # nothing runs and the first waiting request cannot fit


@dataclass(frozen=True)
class Limits:
    max_rows: int
    max_batch_tokens: int  # prompt tokens one step prefills (a lone longer prompt goes)
    online_rows: int  # rows kept free of batch lines (registry)
    packed: bool  # prompts packed without padding (the varlen path) or padded


class Scheduler:
    """One run's waiting requests (batch lines and online requests) and its plans."""

    def __init__(
        self,
        rows: Rows,
        requests: Iterable[Item],
        feed: LaneFeed | None,
        streams: Streams,
        *,
        limits: Limits,
        start: Start,
    ) -> None:
        self.rows = rows
        self.packed = limits.packed
        self.intake = Intake(
            requests,
            max_rows=limits.max_rows,
            max_batch_tokens=limits.max_batch_tokens,
            start=start,
        )
        # Online requests go first, taking batch rows when none are free (lane.py).
        self.lane = Lane(
            rows,
            self.intake,
            feed,
            streams,
            start=start,
            reserve=limits.online_rows,
            max_batch_tokens=limits.max_batch_tokens,
        )

    def plan(self) -> Generator[GenResult | Scoring, None, Plan]:
        """The next step's plan; yields the results of requests that end without a row,
        and the requests whose prompts need echo scores before they go on."""
        rows, intake, lane = self.rows, self.intake, self.lane
        lora = rows.lora
        if lora is not None:
            lora.new_round()
        units = yield from lane.admit()
        kv_cost, prompt_cost = rows.kv.admission_costs()
        batch = yield from intake.admit(
            lane.batch_rows(bool(units)),
            packed=self.packed,
            kv_free=rows.kv.free,
            kv_cost=kv_cost,
            prompt_cost=prompt_cost,
            running=self._running,
            # An online request waiting for its grammar keeps the loop from waiting on
            # the batch source (the lane waits for the grammar).
            idle=not rows.live and not lane.waiting,
            gate=lora.gate if lora is not None else None,
        )
        lane.started(batch)
        units += batch
        waiting = bool(intake.pending)
        return Plan(
            units,
            compact=not units and not waiting and rows.compactable(),
            stuck=not units and not rows.live and waiting and not lane.waiting,
        )

    def reject_head(self) -> GenResult:
        """The first waiting request cannot fit even in an empty cache: its 400."""
        return self.intake.reject_head(self.rows.kv.capacity_tokens)

    @property
    def drained(self) -> bool:
        """Nothing waits and the source has ended: the run ends once no row runs."""
        return self.intake.drained and not self.lane.waiting

    def drop(self, keys: AbstractSet[Any]) -> None:
        """Requests cancelled: their waiting candidates go (rows: the runner's)."""
        self.intake.drop(keys)
        self.lane.drop(keys)

    def _running(self) -> Counter[Hashable]:
        return Counter(q.job.group for q in self.rows.seqs if q is not None)
