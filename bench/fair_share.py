"""Fair share, measured: project B's small batch while project A's big batch runs.

Demo model, a throwaway Postgres database, default settings unless given, in a deployment
topology (`--topology`):
  one-worker  one `batchwright worker`, the README's by-hand deployment (its control
              worker beside it: worker/supervisor.py);
  split       one `batchwright worker --control-only` and one `--no-control` model worker;
  thread      no Celery: a thread of this process runs the real runner.process loop and
              validation is called directly (the fair share of the claims alone).
The first two run real worker processes on a Redis server of the bench's own (a free
port; `redis-server` must be installed) with the default work slice (60 s), and time B
from its submission, validation included: in one worker's solo pool a validation used to
wait for the generation slice of another batch (issue 22).

Phases: 0. a warm-up batch (the worker loads the model; not timed); 1. B alone on the idle
system; 2. A alone; 3. A again, with B submitted once A is 10 % through: B's time and A's.
Printed: B's time under load over its idle time (target <= 3x) and A's throughput drop
(target <= 10 %), plus how many of A's lines finished while B was waiting. One run; on a
shared machine the phases see different load, so read the figures with that in mind.

    PYTHONPATH=src python bench/fair_share.py [--topology one-worker|split|thread]
        [--a-lines 20000] [--b-lines 20]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    demo_home,
    demo_lines,
    done_lines,
    private_redis,
    submit,
    temp_database,
)

TOPOLOGIES = {
    "one-worker": [["worker"]],
    "split": [["worker", "--control-only"], ["worker", "--no-control"]],
}


@contextmanager
def worker_processes(commands: list[list[str]], env: dict[str, str]) -> Iterator[None]:
    """`batchwright ...` processes, each in a process group of its own, stopped at the end
    with SIGTERM (they finish what they hold) and killed if they linger."""
    logs = Path(tempfile.mkdtemp(prefix="bw-fair-share-"))
    procs = []
    for i, args in enumerate(commands):
        with (logs / f"{i}-{args[-1].strip('-')}.log").open("wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "batchwright.cli", *args, "--loglevel", "WARNING"],
                    env={**os.environ, **env},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    print(f"   worker logs: {logs}", flush=True)
    try:
        yield
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def thread_worker(
    model_path: Path, max_rows: int
) -> tuple[Callable[[str], None], Callable[[], None]]:
    """The `thread` topology: a worker loop in this process; validation called directly."""
    from batchwright import control
    from batchwright.config import get_settings
    from batchwright.engine.engine import Engine
    from batchwright.registry import ModelSpec, Registry
    from batchwright.worker.generation import runner

    spec = ModelSpec(name="demo", path=model_path, max_rows=max_rows)
    registry = Registry(models={"demo": spec})
    engine = Engine.load(spec)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            if runner.process("demo", registry, lambda _: engine) == 0:
                time.sleep(0.02)  # a real worker waits for a wake-up message here

    # As a worker: its lease process started once, before any timing, and the engine's
    # CPU threads set (runner.set_cpu_threads).
    runner.process("demo", registry, lambda _: engine)
    runner.set_cpu_threads(engine, get_settings())
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()

    def close() -> None:
        stop.set()
        thread.join()

    return (lambda batch_id: control.validate_batch(batch_id, registry)), close


def status(batch_id: str) -> str:
    from batchwright.db.models import Batch
    from batchwright.db.session import session_scope

    with session_scope() as session:
        batch = session.get(Batch, batch_id)
        return batch.status if batch is not None else "missing"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--topology", choices=[*TOPOLOGIES, "thread"], default="one-worker")
    parser.add_argument("--a-lines", type=int, default=20000)
    parser.add_argument("--b-lines", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-rows", type=int, default=64)
    args = parser.parse_args()

    home = demo_home()
    model = {"path": str(home / "models" / "demo"), "max_rows": args.max_rows}
    a_lines = demo_lines(args.a_lines, max_tokens=args.max_tokens, seed=1)
    b_lines = demo_lines(args.b_lines, max_tokens=args.max_tokens, seed=2)
    print(f"topology: {args.topology}", flush=True)

    with ExitStack() as stack:
        validate: Callable[[str], None]
        if args.topology == "thread":
            stack.enter_context(temp_database(home=str(home), work_slice_seconds="3600"))
            validate, close = thread_worker(home / "models" / "demo", args.max_rows)
            stack.callback(close)
        else:
            broker = stack.enter_context(private_redis())
            settings = {
                "home": str(home),
                "broker_url": broker,
                "queue": f"bw-fair-{uuid.uuid4().hex[:8]}",
                "models": json.dumps({"models": {"demo": model}}),
            }
            url = stack.enter_context(temp_database(**settings))
            from batchwright.controlplane.dispatch import CeleryDispatcher, set_dispatcher

            set_dispatcher(CeleryDispatcher())  # validation is the workers' (control queue)
            env = {f"BATCHWRIGHT_{k.upper()}": v for k, v in settings.items()}
            env["BATCHWRIGHT_DATABASE_URL"] = url
            stack.enter_context(worker_processes(TOPOLOGIES[args.topology], env))
            validate = lambda _: None  # noqa: E731  (the workers' control consumer does)

        def start(project: str, lines: list[object]) -> tuple[str, float]:
            t0 = time.perf_counter()
            batch_id = submit(project, lines)
            validate(batch_id)
            return batch_id, t0

        started: dict[str, float] = {}  # when each batch was first seen validated

        def wait(batch_id: str, n: int) -> float:
            while done_lines(batch_id) < n:
                if batch_id not in started and status(batch_id) != "validating":
                    started[batch_id] = time.perf_counter()
                time.sleep(0.01)
            started.setdefault(batch_id, time.perf_counter())
            return time.perf_counter()

        warm_id, _ = start("warm-up", demo_lines(20, max_tokens=args.max_tokens, seed=3))
        wait(warm_id, 20)

        b_id, t0 = start("team-b", b_lines)
        b_idle = wait(b_id, args.b_lines) - t0
        b_idle_valid = started[b_id] - t0
        print(f"1. B alone ({args.b_lines} lines): {b_idle:.2f} s", flush=True)

        a_id, t0 = start("team-a", a_lines)
        a_alone = wait(a_id, args.a_lines) - t0
        print(f"2. A alone ({args.a_lines} lines): {a_alone:.1f} s", flush=True)

        a_id, t_a = start("team-a", a_lines)
        while done_lines(a_id) < args.a_lines // 10:
            time.sleep(0.05)
        a_at_b = done_lines(a_id)
        b_id, t_b = start("team-b", b_lines)
        b_loaded = wait(b_id, args.b_lines) - t_b
        b_loaded_valid = started[b_id] - t_b
        a_during = done_lines(a_id) - a_at_b
        a_with_b = wait(a_id, args.a_lines) - t_a

    print(f"3. with A running: B {b_loaded:.2f} s; A {a_with_b:.1f} s")
    print(f"   B validated after {b_idle_valid:.2f} s alone, {b_loaded_valid:.2f} s with A")
    print(f"   A lines finished while B ran: {a_during}")
    print(f"B under load / B idle:  {b_loaded / b_idle:.2f}x   (target <= 3x)")
    print(f"A throughput drop:      {100 * (1 - a_alone / a_with_b):.1f} %   (target <= 10 %)")


if __name__ == "__main__":
    main()
