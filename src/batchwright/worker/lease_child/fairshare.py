"""Fair share of a model's capacity between projects, then between a project's batches.

Instead of oldest batch first, every claim hands its slots out by deficit round-robin over
the projects that have queued lines for the model. A project's standing is the rows it
already holds in flight for the model divided by its weight (Project.weight, default
`default_project_weight`): each slot goes to the project lowest on that measure, then,
inside the project, to its batch holding the fewest rows (oldest first on ties). The state
lives in the rows themselves (state = 'running'), so every worker of every host sees the
same standings without a shared counter, and a crashed worker's share frees up with its
lease. No starvation: a project with queued lines and weight w > 0 gets a slot whenever it
holds less than w/sum(w) of the rows in flight, and a new project holds none.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import ColumnElement, Connection, Select, bindparam, func, or_, select
from sqlalchemy.orm import Session

from batchwright import catalog
from batchwright.config import get_settings
from batchwright.controlplane import budget
from batchwright.db.models import Batch, BatchRequest, Project

# Rounds of re-allocation when a batch had fewer claimable lines than its share.
_ROUNDS = 3


@dataclass
class Flow:
    """One batch with queued lines for the model."""

    batch_id: str
    project_id: str
    weight: float
    created_at: int
    held: int = 0  # its lines in flight


def allocate(flows: Sequence[Flow], slots: int, project_held: dict[str, int]) -> dict[str, int]:
    """Slots per batch id. `project_held`: rows each project holds in flight for the model,
    counting its batches that have nothing queued any more."""
    by_project: dict[str, list[Flow]] = defaultdict(list)
    for flow in flows:
        by_project[flow.project_id].append(flow)
    held = {p: project_held.get(p, 0) for p in by_project}
    weight = {p: max(fs[0].weight, 1e-6) for p, fs in by_project.items()}
    oldest = {p: min((f.created_at, f.batch_id) for f in fs) for p, fs in by_project.items()}
    batch_held = {f.batch_id: f.held for f in flows}
    give: dict[str, int] = defaultdict(int)
    for _ in range(slots):
        # The project whose next row would leave it least served, relative to its weight.
        project = min(by_project, key=lambda p: ((held[p] + 1) / weight[p], oldest[p]))
        flow = min(
            by_project[project],
            key=lambda f: (batch_held[f.batch_id], f.created_at, f.batch_id),
        )
        give[flow.batch_id] += 1
        batch_held[flow.batch_id] += 1
        held[project] += 1
    return dict(give)


def _flows_statement(filters: ColumnElement[bool]) -> Select[str, str, float | None, int]:
    has_queued = select(BatchRequest.id).where(
        BatchRequest.batch_id == Batch.id, BatchRequest.state == "queued", filters
    )
    return (
        select(Batch.id, Batch.project_id, Project.weight, Batch.created_at)
        .join(Project, Project.id == Batch.project_id)
        .where(
            Batch.status == "in_progress",
            Batch.model.in_(bindparam("models", expanding=True)),
            # Past its window a batch gets no new work: its finalize expires what is left.
            or_(Batch.expires_at.is_(None), Batch.expires_at > bindparam("now")),
            has_queued.exists(),
        )
    )


def _take_statement(filters: ColumnElement[bool]) -> Select[int]:
    return (
        select(BatchRequest.id)
        .where(
            BatchRequest.batch_id == bindparam("batch_id"),
            BatchRequest.state == "queued",
            filters,
        )
        # Lines that start alike together (issue 14): a worker prefills a shared prefix
        # once for the lines it claims.
        .order_by(BatchRequest.prefix_key, BatchRequest.line_no)
        .limit(bindparam("n"))
        .with_for_update(skip_locked=True, of=BatchRequest)
    )


# Built once (a claim's CPU is taken from its worker's generation loop), for lines that may
# share a run and for suspects (controlplane/budget.py), their limits bound per claim.
_FLOWS = {False: _flows_statement(budget.BATCHED), True: _flows_statement(budget.SUSPECT)}
_TAKE = {False: _take_statement(budget.BATCHED), True: _take_statement(budget.SUSPECT)}
_HELD_IN_FLIGHT = (
    select(BatchRequest.batch_id, Batch.project_id, func.count())
    .join(Batch, Batch.id == BatchRequest.batch_id)
    .where(BatchRequest.state == "running", Batch.model.in_(bindparam("models", expanding=True)))
    .group_by(BatchRequest.batch_id, Batch.project_id)
)


def active_flows(
    conn: Connection, models: list[str], suspects: bool, limits: dict[str, int], now: float
) -> list[Flow]:
    default = get_settings().default_project_weight
    rows = conn.execute(_FLOWS[suspects], {"models": models, "now": now, **limits}).all()
    return [
        Flow(bid, pid, float(w if w is not None else default), created)
        for bid, pid, w, created in rows
    ]


def held_in_flight(conn: Connection, models: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    """Rows in flight for the models: per batch and per project."""
    per_batch: dict[str, int] = {}
    per_project: dict[str, int] = defaultdict(int)
    for batch_id, project_id, count in conn.execute(_HELD_IN_FLIGHT, {"models": models}):
        per_batch[batch_id] = count
        per_project[project_id] += count
    return per_batch, per_project


def pick(session: Session, model: str, limit: int, *, suspects: bool = False) -> list[int]:
    """Ids of up to `limit` queued lines of `model`, locked (SKIP LOCKED), shared fairly.

    `suspects`: lines that must run alone instead of those that may share (controlplane/budget.py).
    The lines of `model`'s LoRA adapters are its lines too: one share of the model's
    rows between every project, whichever adapters their batches name."""
    conn = session.connection()
    limits = budget.limits(get_settings(), suspects=suspects)
    models = catalog.family(session, model)
    flows = active_flows(conn, models, suspects, limits, time.time())
    if not flows:
        return []
    project_held: dict[str, int] = {}
    if len(flows) > 1:
        per_batch, project_held = held_in_flight(conn, models)
        for flow in flows:
            flow.held = per_batch.get(flow.batch_id, 0)
    by_id = {f.batch_id: f for f in flows}
    ids: list[int] = []
    for _ in range(_ROUNDS):
        short = False
        shares = allocate(list(by_id.values()), limit - len(ids), project_held)
        for batch_id, n in sorted(shares.items()):
            params = {"batch_id": batch_id, "n": n, **limits}
            got = list(conn.execute(_TAKE[suspects], params).scalars())
            ids += got
            flow = by_id[batch_id]
            flow.held += len(got)
            project_held[flow.project_id] = project_held.get(flow.project_id, 0) + len(got)
            if len(got) < n:  # drained, or the rest is locked by another claim
                del by_id[batch_id]
                short = True
        if not short or not by_id or len(ids) >= limit:
            break
    return ids
