"""Control-plane capacity: N simulated workers against one Postgres, an engine stub that
answers every request at once. This measures claims and result writes (fair-share claims,
read-ahead, the writer thread, lease rules), not generation.

Each worker is a thread running the real runner.process -> Lease -> pipeline path with its
own lease (the in-process form of a worker's lease process: the same statements); they
drain one model's queue of LINES lines spread over 4 projects. Printed per
N: lines/s, SQL statements and transactions per line (a transaction adds BEGIN and COMMIT
round trips), and round trips per line = statements + 2 x transactions + pool pings. The
simulated workers share one pool of at most --connections server connections (a worker
holds up to three: claims, result writes, lease renewals), as they would behind PgBouncer.
Threads share one Python process (the GIL): at high N the client side on this machine,
not Postgres, may be the limit; Postgres's own CPU share is printed to tell which.

    PYTHONPATH=src python bench/control_plane.py [--workers 1,4,16,64] [--lines 8000]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import demo_lines, submit, temp_database


class InstantEngine:
    """Answers every request at once with a minimal Completion."""

    max_rows = 64

    def run(
        self, requests: Iterable[Any], cancelled: Callable[[], Any] | None = None
    ) -> Iterator[Any]:
        # `cancelled` is the engine's cancel hook (the engine host passes the lease's);
        # an engine that answers at once has nothing in flight to drop. WAKE: a lease
        # came, or its lines ended (the host's source).
        from batchwright.engine.requests.types import WAKE, GenResult

        for req in requests:
            if req is WAKE:
                continue
            yield GenResult(
                key=req.key,
                status_code=200,
                completion={"id": "cmpl-" + uuid.uuid4().hex, "model": "demo", "choices": []},
                prompt_tokens=8,
                completion_tokens=16,
            )


class Counter:
    def __init__(self) -> None:
        self.statements = self.transactions = self.checkouts = 0
        self.lock = threading.Lock()

    def attach(self, engine: Any) -> None:
        from sqlalchemy import event

        def stmt(*_: Any) -> None:
            with self.lock:
                self.statements += 1

        def tx(*_: Any) -> None:
            with self.lock:
                self.transactions += 1

        def checkout(*_: Any) -> None:
            with self.lock:
                self.checkouts += 1

        event.listen(engine, "before_cursor_execute", stmt)
        event.listen(engine, "commit", tx)
        event.listen(engine, "rollback", tx)
        event.listen(engine.pool, "checkout", checkout)


def pg_cpu_seconds() -> float:
    """CPU time of every postgres process on this host (utime + stime, from /proc)."""
    import os

    total = 0
    hz = os.sysconf("SC_CLK_TCK")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as fh:
                parts = fh.read().rsplit(")", 1)
            if "postgres" not in parts[0]:
                continue
            fields = parts[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return total / hz


def run(n: int, lines: int, max_connections: int) -> dict[str, float]:
    from sqlalchemy import func, select

    from batchwright import control
    from batchwright.db.models import BatchRequest
    from batchwright.db.session import get_engine, session_scope
    from batchwright.registry import ModelSpec, Registry
    from batchwright.worker.generation import runner

    # One pool shared by every simulated worker, as a PgBouncer in front of Postgres would
    # be: at most `max_connections` server connections (this Postgres allows 100, shared
    # with other users), threads wait for one when all are busy.
    pool = str(min(3 * n, max_connections))
    # Claims and writes in threads of this process (lease_process off): the statements are
    # the lease process's, but here they can be counted and share one pool.
    with temp_database(
        work_slice_seconds="3600",
        database_pool_size=pool,
        database_max_overflow="0",
        lease_process="false",
    ):
        spec = ModelSpec(name="demo", path=Path("/nonexistent"))
        registry = Registry(models={"demo": spec})
        per = lines // 4
        batches = [submit(f"project-{p}", demo_lines(per, seed=p)) for p in range(4)]
        for batch_id in batches:
            control.validate_batch(batch_id, registry)
        counter = Counter()
        counter.attach(get_engine(None))  # the key session_scope() uses
        engine = InstantEngine()

        def queued() -> int:
            with session_scope() as session:
                return int(
                    session.scalar(
                        select(func.count()).where(BatchRequest.state.in_(("queued", "running")))
                    )
                    or 0
                )

        def worker() -> None:
            while True:
                landed = runner.process("demo", registry, lambda _: engine)
                if landed == 0:
                    if queued() == 0:
                        return
                    time.sleep(0.05)  # a real worker waits for its next wake-up message

        threads = [threading.Thread(target=worker) for _ in range(n)]
        cpu0, t0 = pg_cpu_seconds(), time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        pg_cpu = pg_cpu_seconds() - cpu0
        done = per * 4
        return {
            "lines_per_s": done / elapsed,
            "statements": counter.statements / done,
            "transactions": counter.transactions / done,
            "round_trips": (counter.statements + 2 * counter.transactions + counter.checkouts)
            / done,
            "pg_cpu_share": pg_cpu / elapsed,
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", default="1,4,16,64")
    parser.add_argument("--lines", type=int, default=8000)
    parser.add_argument("--connections", type=int, default=24, help="server connections")
    args = parser.parse_args()
    print(
        f"{args.lines} lines over 4 projects, claim size 64, instant engine stub, "
        f"at most {args.connections} connections"
    )
    print(
        "| workers | lines/s | statements/line | transactions/line | round trips/line "
        "| Postgres CPU (cores) |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in args.workers.split(",")):
        r = run(n, args.lines, args.connections)
        print(
            f"| {n} | {r['lines_per_s']:.0f} | {r['statements']:.3f} | {r['transactions']:.3f} "
            f"| {r['round_trips']:.3f} | {r['pg_cpu_share']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
