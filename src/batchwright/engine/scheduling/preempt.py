"""Batch lines giving their rows to online requests.

When the rows or the KV budget are full of batch rows, an online request takes them from
the batch lines admitted last (the youngest: the least work lost). A preempted line
leaves the engine at once (its rows end, its blocks are freed) and goes back to the front
of the waiting lines as it was before its first row ran: its candidates start again from
the prompt, each seeded generator from its seed, so the line's result is the one it
would have had (greedy and seeded lines give the same text). Nothing of the first run
reaches the result: no tokens are counted, no result is yielded for it, and the worker
never hears of it (the line is not charged an attempt).

The echo scores and the prefix-cache hits of the first admission are kept: both belong
to the line, not to the run (usage reports the cached tokens of the first prefill).
"""

from __future__ import annotations

import dataclasses

from batchwright.engine.requests.jobs import Job, Seq, row_rng
from batchwright.engine.scheduling.intake import Intake
from batchwright.engine.scheduling.rows import Rows
from batchwright.engine.text.stop import StopChecker


def restart(job: Job) -> Job:
    """The job as `start` made it: same id, prompts and parameters, fresh candidates."""
    fresh = dataclasses.replace(
        job, seqs=[], cached_tokens=dict(job.cached_tokens), requeued=True, admitted=0
    )
    for s in job.seqs:
        rng = row_rng(job.req.seed, s.prompt_index, s.cand)
        params = dataclasses.replace(s.params, rng=rng)
        stop = StopChecker(s.stop.stops, s.stop.decode, s.stop.grow)
        fresh.seqs.append(Seq(fresh, s.prompt_index, s.cand, params, stop))
    fresh.remaining = len(fresh.seqs)
    return fresh


def youngest(seqs: list[Seq | None]) -> Job | None:
    """The batch job with running rows that was admitted last."""
    best: Job | None = None
    for q in seqs:
        if q is not None and not q.job.online and (best is None or q.job.admitted > best.admitted):
            best = q.job
    return best


def preempt(rows: Rows, intake: Intake, job: Job) -> int:
    """Take `job`'s rows away and put it back at the front of the waiting lines; returns
    the rows freed."""
    mine = [i for i, q in enumerate(rows.seqs) if q is not None and q.job is job]
    rows.end(mine)
    intake.drop({job.key})  # its prompts still waiting for rows start over too
    intake.requeue(restart(job))
    return len(mine)
