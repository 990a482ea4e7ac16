"""Fair share, measured: project B's small batch while project A's big batch runs.

One worker (a thread running the real runner.process loop, demo model, default settings
unless given) against a throwaway Postgres database, in three phases:
  1. B alone on the idle system: B's time from validated to its last line written;
  2. A alone: A's time to drain;
  3. A again, with B submitted once A is 10 % through: B's time and A's time.
Printed: B's time under load over its idle time (target <= 3x) and A's throughput drop
(target <= 10 %), plus how many of A's lines finished while B was waiting. One run; on a
shared machine the phases see different load, so read the figures with that in mind.

    PYTHONPATH=src python bench/fair_share.py [--a-lines 20000] [--b-lines 20]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import demo_home, demo_lines, done_lines, submit, temp_database


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--a-lines", type=int, default=20000)
    parser.add_argument("--b-lines", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-rows", type=int, default=64)
    args = parser.parse_args()

    from batchwright import control
    from batchwright.engine.runtime import Engine
    from batchwright.registry import ModelSpec, Registry
    from batchwright.worker import runner

    home = demo_home()
    spec = ModelSpec(name="demo", path=home / "models" / "demo", max_rows=args.max_rows)
    registry = Registry(models={"demo": spec})
    engine = Engine.load(spec)
    a_lines = demo_lines(args.a_lines, max_tokens=args.max_tokens, seed=1)
    b_lines = demo_lines(args.b_lines, max_tokens=args.max_tokens, seed=2)

    with temp_database(home=str(home), work_slice_seconds="3600"):
        stop = threading.Event()

        def worker() -> None:
            while not stop.is_set():
                if runner.process("demo", registry, lambda _: engine) == 0:
                    time.sleep(0.02)  # a real worker waits for a wake-up message here

        # As a worker: its lease process started once, before any timing, and the engine's
        # CPU threads set (runner.set_cpu_threads).
        runner.process("demo", registry, lambda _: engine)
        runner.set_cpu_threads(engine, runner.get_settings())
        thread = threading.Thread(target=worker, daemon=True)
        thread.start()

        def start(project: str, lines: list[object]) -> tuple[str, float]:
            batch_id = submit(project, lines)
            control.validate_batch(batch_id, registry)
            return batch_id, time.perf_counter()

        def wait(batch_id: str, n: int) -> float:
            while done_lines(batch_id) < n:
                time.sleep(0.005)
            return time.perf_counter()

        b_id, t0 = start("team-b", b_lines)
        b_idle = wait(b_id, args.b_lines) - t0
        print(f"1. B alone ({args.b_lines} lines): {b_idle:.2f} s", flush=True)

        a_id, t0 = start("team-a", a_lines)
        a_alone = wait(a_id, args.a_lines) - t0
        print(f"2. A alone ({args.a_lines} lines): {a_alone:.1f} s", flush=True)

        a_id, t_a = start("team-a", a_lines)
        while done_lines(a_id) < args.a_lines // 10:
            time.sleep(0.05)
        b_id, t_b = start("team-b", b_lines)
        a_at_b = done_lines(a_id)
        b_loaded = wait(b_id, args.b_lines) - t_b
        a_during = done_lines(a_id) - a_at_b
        a_with_b = wait(a_id, args.a_lines) - t_a
        stop.set()
        thread.join()

    print(f"3. with A running: B {b_loaded:.2f} s; A {a_with_b:.1f} s")
    print(f"   A lines finished while B ran: {a_during}")
    print(f"B under load / B idle:  {b_loaded / b_idle:.2f}x   (target <= 3x)")
    print(f"A throughput drop:      {100 * (1 - a_alone / a_with_b):.1f} %   (target <= 10 %)")


if __name__ == "__main__":
    main()
