"""How many online requests an API process holds at once, in all and per project.

A request holds a slot from the moment its key checked out (before its body is read: a
body may be megabytes) to its end. Past the process's cap a request is a 503, past its
project's a 429, both at once and with Retry-After: one tenant's burst gets 429s instead
of taking every connection, thread and megabyte of the process from the others.
Counted in the process (its event loop only): the caps bound what one process holds, and
a process that dies holds nothing.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from batchwright.errors import RateLimited, Unavailable

# What a refused client is told to wait: requests end within seconds on a busy service.
RETRY_SECONDS = 1.0


@dataclass
class Slot:
    owner: InFlight
    project_id: str
    held: bool = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.owner._release(self.project_id)


class InFlight:
    def __init__(self, total: int, per_project: int) -> None:
        self.total_cap = total
        self.project_cap = per_project
        self.total = 0
        self.projects: Counter[str] = Counter()

    def acquire(self, project_id: str) -> Slot:
        """A slot for a request of `project_id`; RateLimited (429) or Unavailable (503)."""
        if self.total_cap and self.total >= self.total_cap:
            raise Unavailable(
                f"This API process holds {self.total} online requests, its limit "
                "(BATCHWRIGHT_ONLINE_MAX_IN_FLIGHT); retry shortly.",
                code="server_busy",
                retry_after=RETRY_SECONDS,
            )
        if self.project_cap and self.projects[project_id] >= self.project_cap:
            raise RateLimited(
                f"Too many concurrent requests: the project has {self.projects[project_id]} "
                f"online requests in progress, the limit of one API process "
                f"(BATCHWRIGHT_ONLINE_MAX_IN_FLIGHT_PER_PROJECT). Retry when one has ended.",
                limit="requests",
                retry_after=RETRY_SECONDS,
            )
        self.total += 1
        self.projects[project_id] += 1
        return Slot(self, project_id)

    def _release(self, project_id: str) -> None:
        self.total -= 1
        self.projects[project_id] -= 1
        if self.projects[project_id] <= 0:
            del self.projects[project_id]
