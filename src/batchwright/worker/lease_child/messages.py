"""Every message between the generation process and its lease child, either way.

They travel pickled over the socket pair (multiprocessing's Connection); NamedTuples pickle
about as small and fast as the plain tuples they replace, and each side matches on the
type instead of a string tag.

The generation process (generation/lease_process.py) opens a lease, grants credit for
requests as the engine takes them, sends results, asks to stop claiming, and closes the
lease; the lease child (serve.py) answers the open, sends requests and their end, the
lines of cancelled batches, its counters and failures, and the close. The child sends a
batch's finalize itself (Celery); only where the generation process's dispatcher is in
that process (the embedded run on Postgres, in-process tests) does it come over as a
`Dispatch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any, NamedTuple

from batchwright.engine.requests.types import GenRequest, GenResult


class Failure(NamedTuple):
    """What failed, and whether it was the infrastructure's doing (controlplane/budget.py):
    a lost run, charged to no line."""

    text: str
    infrastructure: bool


class Counters(NamedTuple):
    """The lease's counters since the last report, for the served metrics."""

    renewals: int = 0
    expired: int = 0
    write_seconds: Sequence[float] = ()


# --- generation process to lease child ------------------------------------------------------


class Open(NamedTuple):
    """Open a lease on `model`'s lines; `window`: requests to send before any credit;
    `relay`: the worker's dispatcher is in its process, so the child's messages go to it
    (`Dispatch`) rather than to Celery."""

    model: str
    window: int
    relay: bool


class Credit(NamedTuple):
    """The engine took `n` more requests: send as many more."""

    n: int


class Results(NamedTuple):
    results: list[GenResult]


class Stop(NamedTuple):
    """Claim no more (the worker is shutting down); what is held runs to its end."""


class Close(NamedTuple):
    """Close the lease; `error`: why the run failed in the generation process, if it did."""

    error: Failure | None


ToChild = Open | Credit | Results | Stop | Close


# --- lease child to generation process ------------------------------------------------------


class Opened(NamedTuple):
    token: str


class Requests(NamedTuple):
    requests: list[GenRequest]


class End(NamedTuple):
    """No more requests in this lease; `more_work`: queued lines are left for a next one."""

    more_work: bool


class Cancelled(NamedTuple):
    """Held lines of a cancelled batch, closed as cancelled: the engine drops `keys` (the
    child has sent the batch's finalize)."""

    keys: AbstractSet[Any]


class Dispatch(NamedTuple):
    """A message the child sends (a batch's finalize), for a generation process whose
    dispatcher is in-process (`Open.relay`)."""

    task: str
    args: tuple[Any, ...]


class Stats(NamedTuple):
    counters: Counters


class Error(NamedTuple):
    failure: Failure


class Closed(NamedTuple):
    landed: int
    more_work: bool
    counters: Counters


ToWorker = Opened | Requests | End | Cancelled | Dispatch | Stats | Error | Closed
