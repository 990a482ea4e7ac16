"""A line's two budgets: its own attempts, and runs the infrastructure lost.

A claim charges one attempt up front (a worker may die before it can say why). When the
run is lost to something that is not the line's doing (its worker died or lost the
lease, the database or broker failed, the device ran out of memory) the attempt is
refunded and `infra_failures` counts the loss instead, so innocent lines never use up
their attempts on other people's faults. A run that fails with several lines in it (the
engine raised) cannot say which line failed it: the attempt is refunded too and
`shared_failures` counts it. Past a threshold of either count a line runs alone, and a
run alone that fails is the line's own: only those use up its attempts. A line so fails
for good only after failing while it was the only line in its run.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, and_, bindparam, or_

from batchwright.config import Settings
from batchwright.db.models import BatchRequest

# Failed runs shared with other lines before a line runs alone: a run that failed twice
# with this line in it may have failed because of it.
SOLO_AFTER = 2
# Lost runs before a line runs alone: a line that keeps its worker dying is isolated the
# same way. Higher, as an innocent line can be in flight when several workers die.
INFRA_SOLO_AFTER = 4

# Values for rows given back after a lost run: the attempt the claim took is refunded.
LOST_RUN: dict[str, Any] = {
    "attempts": BatchRequest.attempts - 1,
    "infra_failures": BatchRequest.infra_failures + 1,
}
# After a failed run the line shared: refunded as well, and counted toward running alone.
SHARED_RUN: dict[str, Any] = {
    "attempts": BatchRequest.attempts - 1,
    "shared_failures": BatchRequest.shared_failures + 1,
}

_INFRA_NAMES = frozenset(
    {
        "OutOfMemoryError",  # torch.cuda.OutOfMemoryError, matched by name: no torch here
        "OperationalError",  # sqlalchemy, psycopg, kombu
        "InterfaceError",
        "ConnectionError",  # redis, kombu, builtins
        "TimeoutError",
        "BrokenPipeError",
        "ConnectionResetError",
    }
)


def is_out_of_memory(exc: BaseException | None) -> bool:
    return type(exc).__name__ == "OutOfMemoryError"


def is_infrastructure(exc: BaseException | None) -> bool:
    """Whether a run's failure is the infrastructure's, not the lines'."""
    while exc is not None:
        if any(t.__name__ in _INFRA_NAMES for t in type(exc).__mro__):
            return True
        exc = exc.__cause__  # sqlalchemy wraps the driver's error
    return False


# The claim filters, their limits bound per claim (`limits`): the lease child's claims.py
# and fairshare.py (worker/lease_child/) build their statements once, at import, around
# these.
BATCHED: ColumnElement[bool] = and_(
    # Lines that may share a run.
    BatchRequest.attempts < bindparam("attempt_cap"),
    BatchRequest.infra_failures < bindparam("infra_cap"),
    BatchRequest.shared_failures < SOLO_AFTER,
)
SUSPECT: ColumnElement[bool] = and_(
    # Lines that run alone: under both budgets, past one of the solo thresholds.
    BatchRequest.attempts < bindparam("attempt_cap"),
    BatchRequest.infra_failures < bindparam("infra_cap"),
    or_(
        BatchRequest.attempts >= SOLO_AFTER,
        BatchRequest.infra_failures >= INFRA_SOLO_AFTER,
        BatchRequest.shared_failures >= SOLO_AFTER,
    ),
)


def limits(settings: Settings, *, suspects: bool) -> dict[str, int]:
    """The parameters of BATCHED (or SUSPECT, with `suspects`)."""
    if suspects:
        return {"attempt_cap": settings.max_attempts, "infra_cap": settings.max_infra_failures}
    return {
        "attempt_cap": min(SOLO_AFTER, settings.max_attempts),
        "infra_cap": min(INFRA_SOLO_AFTER, settings.max_infra_failures),
    }


def exhausted(settings: Settings) -> ColumnElement[bool]:
    return or_(
        BatchRequest.attempts >= settings.max_attempts,
        BatchRequest.infra_failures >= settings.max_infra_failures,
    )


def final_error(row: BatchRequest, reason: str, settings: Settings) -> dict[str, Any]:
    """The error a line out of budget ends with."""
    if row.attempts >= settings.max_attempts:
        message = f"Failed after {row.attempts} attempts, each with this line alone."
        code = "max_attempts_exceeded"
    else:
        message = (
            f"Its runs were lost {row.infra_failures} times (worker deaths, lost leases, "
            "database or broker errors, out of memory), the last ones with this line alone."
        )
        code = "infrastructure_failures_exceeded"
    return {
        "message": f"{message} Last error: {reason}",
        "type": "server_error",
        "param": None,
        "code": code,
    }
