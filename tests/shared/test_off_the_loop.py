"""Invariant 10: the generation loop never waits on the database. With result writes
blocked behind a lock, the engine keeps generating; once the lock goes, every result lands
(same lease rules), exactly once."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any

import psycopg

from tests.helpers import jsonl, line, submit
from tests.shared.conftest import Service
from tests.shared.test_routing import recorder  # noqa: F401  (fixture)

LINES = 200


class CountingEngine:
    """Answers each request at once and counts what it produced."""

    max_rows = 16

    def __init__(self) -> None:
        self.produced = 0

    def run(self, requests: Iterable[Any], **_: Any) -> Iterator[Any]:
        from batchwright.engine.requests.types import WAKE, GenResult

        for req in requests:
            if req is WAKE:  # a lease came, or its lines ended (the engine host's source)
                continue
            self.produced += 1
            yield GenResult(
                key=req.key,
                status_code=200,
                completion={"id": f"cmpl-t{req.key[0]}", "model": "demo-b", "choices": []},
                prompt_tokens=3,
                completion_tokens=4,
            )


def test_generation_runs_on_while_result_writes_are_blocked(
    svc: Service,
    recorder: Any,  # noqa: F811
) -> None:
    from batchwright import control
    from batchwright.registry import load_registry
    from batchwright.worker.generation import runner

    client = svc.client(svc.key("team-loop"))
    batch = submit(client, jsonl([line(f"x{i}", {"model": "demo-b"}) for i in range(LINES)]))
    control.validate_batch(batch.id, load_registry())
    engine = CountingEngine()

    # Hold the batch row: every result write needs it (write_results locks it first).
    blocker = psycopg.connect(svc.pg_url)
    blocker.execute("SELECT id FROM batches WHERE id = %s FOR UPDATE", (batch.id,))
    worker = threading.Thread(
        target=runner.process, args=("demo-b", None, lambda _: engine), daemon=True
    )
    worker.start()
    try:
        # The loop runs on: at least 100 results produced while none could land.
        svc.wait(lambda: engine.produced >= 100, 60, "generation while writes block")
        landed = svc.sql(
            "SELECT count(*) FROM batch_requests WHERE batch_id = %s AND state = 'succeeded'",
            batch.id,
        )[0][0]
        assert landed == 0
    finally:
        blocker.commit()
        blocker.close()
    worker.join(timeout=120)
    assert not worker.is_alive()
    rows = svc.sql(
        "SELECT state, count(*) FROM batch_requests WHERE batch_id = %s GROUP BY state",
        batch.id,
    )
    assert rows == [("succeeded", LINES)]
    completions = svc.sql("SELECT count(*) FROM completions WHERE batch_id = %s", batch.id)
    assert completions[0][0] == LINES
