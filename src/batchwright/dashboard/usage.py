"""A project's usage of the online endpoints over the last day, per model, from the usage
rows (`online_requests`) the API writes."""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from batchwright.db.models import OnlineUsage

DAY = 24 * 3600


@dataclass(frozen=True)
class OnlineModelUsage:
    model: str
    requests: int
    failed: int  # ended with a 4xx or 5xx (a disconnect is not a failure of the service)
    disconnected: int
    prompt_tokens: int
    completion_tokens: int
    mean_ttft: float | None  # seconds, streamed requests that sent a chunk

    @property
    def mean_ttft_ms(self) -> str:
        return "-" if self.mean_ttft is None else f"{self.mean_ttft * 1000:.0f} ms"


def online_usage(
    session: Session, project_id: str, now: float | None = None
) -> list[OnlineModelUsage]:
    since = (now or time.time()) - DAY
    failed = case(((OnlineUsage.status >= 400) & (OnlineUsage.status != 499), 1), else_=0)
    gone = case((OnlineUsage.disconnected, 1), else_=0)
    rows = session.execute(
        select(
            OnlineUsage.model,
            func.count(),
            func.sum(failed),
            func.sum(gone),
            func.sum(OnlineUsage.prompt_tokens),
            func.sum(OnlineUsage.completion_tokens),
            func.avg(OnlineUsage.time_to_first_token),
        )
        .where(OnlineUsage.project_id == project_id, OnlineUsage.created_at >= since)
        .group_by(OnlineUsage.model)
        .order_by(OnlineUsage.model)
    )
    out = []
    for model, n, f, g, p, c, t in rows:
        ttft = None if t is None else float(t)
        counts = (int(n), int(f or 0), int(g or 0), int(p or 0), int(c or 0))
        out.append(OnlineModelUsage(model or "-", *counts, ttft))
    return out
