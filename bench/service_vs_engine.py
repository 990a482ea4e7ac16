"""The worker's service path against the engine alone, on the same 2,000-line demo file.

    engine alone:  Engine.run over the 2,000 requests, nothing else
    service path:  runner.process on the validated batch in Postgres (claims read ahead,
                   results written off the loop by pipeline.py), until every line landed
    synchronous:   the same with the claims and writes inline in the loop (how it was
                   before: shown for comparison)

Validation and finalize are timed apart (they run on the control queue, not in the loop).
The three run in interleaved rounds and each keeps its best round, so a burst of load on
a shared machine hits all of them alike; every round's figures are printed too.

    PYTHONPATH=src python bench/service_vs_engine.py [--lines 2000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import demo_home, demo_lines, done_lines, submit, temp_database


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from batchwright.engine.runtime import Engine
    from batchwright.engine.types import GenRequest
    from batchwright.registry import ModelSpec, Registry
    from batchwright.worker import runner
    from batchwright.worker.claims import Lease
    from batchwright.worker.results import write_results

    home = demo_home()
    spec = ModelSpec(name="demo", path=home / "models" / "demo")
    registry = Registry(models={"demo": spec})
    engine = Engine.load(spec)
    lines = demo_lines(args.lines, max_tokens=args.max_tokens)
    list(engine.run(GenRequest(key=i, body=x["body"]) for i, x in enumerate(lines[:64])))

    cpu: dict[str, float] = {}

    def alone() -> float:
        start, cpu0 = time.perf_counter(), time.process_time()
        results = list(engine.run(GenRequest(key=i, body=x["body"]) for i, x in enumerate(lines)))
        assert len(results) == len(lines)
        cpu["engine"] = min(cpu.get("engine", 1e9), time.process_time() - cpu0)
        return time.perf_counter() - start

    def service(sync: bool) -> tuple[float, float, float]:
        with temp_database(home=str(home), work_slice_seconds="3600"):
            from batchwright.db.session import session_scope

            batch_id = submit("bench", lines)
            t0 = time.perf_counter()
            runner.validate_batch(batch_id, registry)
            t_validate = time.perf_counter() - t0
            t0, cpu0 = time.perf_counter(), time.process_time()
            if sync:
                settings = runner.get_settings()
                with Lease("demo", settings, runner.SHUTDOWN) as lease:
                    buffer = []
                    for result in engine.run(lease.requests()):
                        buffer.append(result)
                        if len(buffer) >= 32:
                            with session_scope() as session:
                                write_results(session, lease.token, buffer)
                            buffer = []
                    with session_scope() as session:
                        write_results(session, lease.token, buffer)
            else:
                runner.process("demo", registry, lambda _: engine)
            t_process = time.perf_counter() - t0
            name = "sync" if sync else "service"
            cpu[name] = min(cpu.get(name, 1e9), time.process_time() - cpu0)
            assert done_lines(batch_id) == len(lines), done_lines(batch_id)
            t0 = time.perf_counter()
            runner.finalize_batch(batch_id)
            return t_validate, t_process, time.perf_counter() - t0

    engines, services, syncs = [], [], []
    v = f = 0.0
    for r in range(args.rounds):
        engines.append(alone())
        v, t, f = service(sync=False)
        services.append(t)
        syncs.append(service(sync=True)[1])
        print(
            f"round {r + 1}: engine {engines[-1]:.2f} s, service {services[-1]:.2f} s, "
            f"synchronous {syncs[-1]:.2f} s (wall)",
            flush=True,
        )
    t_engine, t_service, t_sync = min(engines), min(services), min(syncs)
    print(
        f"{args.lines} lines, max_tokens {args.max_tokens}, demo model, CPU, best of {args.rounds}"
    )
    print(f"engine alone                 {t_engine:8.2f} s")
    print(f"service path (pipeline)      {t_service:8.2f} s   {t_service / t_engine:5.2f}x engine")
    print(f"synchronous claims + writes  {t_sync:8.2f} s   {t_sync / t_engine:5.2f}x engine")
    print(f"validation {v:.2f} s, finalize {f:.2f} s (control queue, outside the loop)")
    # CPU time of this process (all its threads): what the path costs the worker host,
    # much less sensitive than wall time to other load on a shared machine.
    print(
        f"CPU seconds of the process: engine {cpu['engine']:.1f}, service {cpu['service']:.1f} "
        f"({cpu['service'] / cpu['engine']:.2f}x), synchronous {cpu['sync']:.1f} "
        f"({cpu['sync'] / cpu['engine']:.2f}x)"
    )


if __name__ == "__main__":
    main()
