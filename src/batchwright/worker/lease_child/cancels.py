"""Cancel reaches lines a worker already holds: the lease's heartbeat thread looks for
its rows of cancelling batches, closes them as `cancelled` and tells the engine, which
drops them at its next step (`Engine.run(..., cancelled=...)`); the batch is finalized
from here, so it is `cancelled` within seconds whatever else this worker is running."""

from __future__ import annotations

import threading
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any

from sqlalchemy import select, update

from batchwright.db.models import Batch, BatchRequest
from batchwright.db.session import session_scope


class CancelWatch:
    def __init__(self, token: str) -> None:
        self.token = token
        # Called with each batch id whose held lines were just cancelled (finalize).
        self.on_batch: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        self._new: set[Any] = set()
        self._all: set[Any] = set()

    def poll(self) -> None:
        """Close this lease's rows of cancelling batches (the heartbeat thread's job)."""
        with session_scope() as session:
            rows = session.execute(
                update(BatchRequest)
                .where(
                    BatchRequest.lease_token == self.token,
                    BatchRequest.state == "running",
                    BatchRequest.batch_id.in_(
                        select(Batch.id).where(Batch.status == "cancelling").scalar_subquery()
                    ),
                )
                .values(state="cancelled", lease_token=None, lease_expires_at=None)
                .returning(BatchRequest.id, BatchRequest.batch_id)
            ).all()
        if not rows:
            return
        keys = {(row_id, batch_id) for row_id, batch_id in rows}
        with self._lock:
            self._new |= keys
            self._all |= keys
        if self.on_batch is not None:
            for batch_id in sorted({batch_id for _, batch_id in rows}):
                self.on_batch(batch_id)

    def drain(self) -> AbstractSet[Any]:
        """Keys cancelled since the last call (the engine asks once per step)."""
        if not self._new:
            return frozenset()
        with self._lock:
            keys, self._new = frozenset(self._new), set()
        return keys

    def __contains__(self, key: Any) -> bool:
        return key in self._all
