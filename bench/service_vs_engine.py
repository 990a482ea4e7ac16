"""The worker's service path against the engine alone, on the same 2,000-line demo file.

    engine alone:  Engine.run over the 2,000 requests, nothing else: with torch's default
                   threads, and again with the service path's (fewer on a CPU-only host)
    service path:  runner.process on the validated batch in Postgres, as a worker runs
                   it: claims and result writes in the lease process
                   (worker/generation/lease_process.py), the engine's CPU threads set as the worker
                   sets them (runner.set_cpu_threads), until every line landed
    threads:       the same with claims and writes in threads of this process
                   (lease_process=false; pipeline.py), for comparison
    in the loop:   the same with claims and writes inline in the loop (how it was first)

Validation and finalize are timed apart (they run on the control queue, not in the loop).
The four run in interleaved rounds and each keeps its best round, so a burst of load on
a shared machine hits all of them alike; every round's figures are printed too.

    PYTHONPATH=src python bench/service_vs_engine.py [--lines 2000] [--rounds 2]
        [--python-bound MS]   # a Python-bound engine instead: MS ms per line
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import demo_home, demo_lines, done_lines, submit, temp_database


class PythonBound:
    """Answers each request after `ms` ms of pure Python: nothing but the GIL and a core.
    Like the engine (engine/scheduling/intake.py) it tops a window up each step with what its source
    holds ready, waiting only when it has nothing to work on."""

    max_rows = 64

    def __init__(self, ms: float) -> None:
        self.seconds = ms / 1000
        self.lm = type("LM", (), {"device": "gpu stand-in"})()

    def run(self, requests: Iterable[Any], cancelled: Any = None) -> Iterator[Any]:
        from batchwright.engine.requests.types import GenResult

        ready = getattr(requests, "ready", None)
        it = iter(requests)
        pending: list[Any] = []
        while True:
            room = 2 * self.max_rows - len(pending)
            n = min(room, ready()) if ready is not None else room
            pending.extend(r for r in (next(it, None) for _ in range(max(n, 0))) if r)
            if not pending:
                first = next(it, None)
                if first is None:
                    return
                pending.append(first)
            req = pending.pop(0)
            end = time.perf_counter() + self.seconds
            while time.perf_counter() < end:
                pass
            completion = {"id": f"cmpl-{req.key}", "model": "demo", "choices": [{"text": "x"}]}
            yield GenResult(key=req.key, status_code=200, completion=completion, prompt_tokens=8)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--python-bound",
        type=float,
        default=0.0,
        metavar="MS",
        help="instead of the demo model, an engine that spends MS ms of pure Python (holding "
        "the GIL) per line: a GPU host's loop, whose time goes to launching kernels",
    )
    args = parser.parse_args()

    import torch

    from batchwright import control
    from batchwright.engine.engine import Engine
    from batchwright.engine.requests.types import GenRequest
    from batchwright.registry import ModelSpec, Registry
    from batchwright.serving.lines import prepared, serve
    from batchwright.worker.generation import engine_host, runner
    from batchwright.worker.lease_child.claims import Lease
    from batchwright.worker.lease_child.results import write_results

    home = demo_home()
    spec = ModelSpec(name="demo", path=home / "models" / "demo")
    registry = Registry(models={"demo": spec})
    engine: Any = PythonBound(args.python_bound) if args.python_bound else Engine.load(spec)
    threads = torch.get_num_threads()  # torch's default: the engine alone runs with it
    lines = demo_lines(args.lines, max_tokens=args.max_tokens)
    warm = (GenRequest(key=i, body=x["body"]) for i, x in enumerate(lines[:64]))
    list(engine.run(prepared(engine, warm)))

    cpu: dict[str, float] = {}

    def alone(leg: str, n_threads: int) -> float:
        torch.set_num_threads(n_threads)
        start, cpu0 = time.perf_counter(), time.process_time()
        reqs = prepared(engine, (GenRequest(key=i, body=x["body"]) for i, x in enumerate(lines)))
        results = list(engine.run(reqs))
        assert len(results) == len(lines)
        cpu[leg] = min(cpu.get(leg, 1e9), time.process_time() - cpu0)
        torch.set_num_threads(threads)
        return time.perf_counter() - start

    def service(mode: str) -> tuple[float, float, float]:
        sync = mode == "sync"
        lease_process = "true" if mode == "process" else "false"
        with temp_database(home=str(home), work_slice_seconds="3600", lease_process=lease_process):
            from batchwright.db.session import session_scope

            # A worker starts its lease process once (worker/generation/lease_process.py): start it
            # here, on an empty queue, not inside the timing; and sets the engine's CPU
            # threads as the worker does (runner.set_cpu_threads).
            runner.process("demo", registry, lambda _: engine)
            # The lease ran in a host of the engine's (runner.host_for), which holds a run
            # of it: stopped, so that the engine's runs here (alone, sync) share its kept
            # device state instead of each building its own.
            engine_host.stop_local()
            runner.set_cpu_threads(engine, runner.get_settings())
            batch_id = submit("bench", lines)
            t0 = time.perf_counter()
            control.validate_batch(batch_id, registry)
            t_validate = time.perf_counter() - t0
            t0, cpu0 = time.perf_counter(), time.process_time()
            if sync:
                settings = runner.get_settings()
                with Lease("demo", settings, runner.SHUTDOWN) as lease:
                    buffer = []
                    for result in serve(engine, lease.requests()):
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
            cpu[mode] = min(cpu.get(mode, 1e9), time.process_time() - cpu0)
            engine_host.stop_local()
            cpu[mode + " threads"] = torch.get_num_threads()
            torch.set_num_threads(threads)
            assert done_lines(batch_id) == len(lines), done_lines(batch_id)
            t0 = time.perf_counter()
            control.finalize_batch(batch_id)
            return t_validate, t_process, time.perf_counter() - t0

    modes = ("process", "threads", "sync")
    walls: dict[str, list[float]] = {m: [] for m in ("engine", *modes, "engine same")}
    v = f = 0.0
    for r in range(args.rounds):
        walls["engine"].append(alone("engine", threads))
        for mode in modes:
            v2, t, f2 = service(mode)
            walls[mode].append(t)
            if mode == "process":
                v, f = v2, f2
        # The engine alone with the service path's torch threads: what the path itself
        # costs, apart from the core a CPU-only worker leaves to its lease process.
        # (The same run as the first leg when the threads are the same: not run twice.)
        same_threads = int(cpu["process threads"])
        if same_threads == threads:
            walls["engine same"].append(walls["engine"][-1])
            cpu["engine same"] = cpu["engine"]
        else:
            walls["engine same"].append(alone("engine same", same_threads))
        print(
            f"round {r + 1}: " + ", ".join(f"{m} {w[-1]:.2f} s" for m, w in walls.items()),
            flush=True,
        )
    best = {m: min(w) for m, w in walls.items()}
    print(
        f"{args.lines} lines, max_tokens {args.max_tokens}, "
        + (
            f"Python-bound engine ({args.python_bound} ms a line)"
            if args.python_bound
            else "demo model"
        )
        + f", CPU, best of {args.rounds}"
    )
    same = int(cpu["process threads"])
    labels = {
        "engine": f"engine alone ({threads} torch threads)",
        "process": f"service path ({same} torch threads)",
        "threads": "  claims + writes in threads",
        "sync": "  claims + writes in the loop",
        "engine same": f"engine alone ({same} torch threads)",
    }
    for mode, label in labels.items():
        ratio = "" if mode == "engine" else f"   {best[mode] / best['engine']:5.2f}x engine"
        print(f"{label:34s}{best[mode]:6.2f} s{ratio}")
    print(
        f"service path against the engine alone with the same {same} torch threads: "
        f"{best['process'] / best['engine same']:.2f}x"
    )
    print(f"validation {v:.2f} s, finalize {f:.2f} s (control queue, outside the loop)")
    # CPU time of this process (all its threads, not the lease process's): what the path
    # costs the generation loop's process, less sensitive than wall time to other load.
    print(
        "CPU seconds of this process: "
        + ", ".join(f"{m} {cpu[m]:.1f}" for m in ("engine", *modes, "engine same"))
    )


if __name__ == "__main__":
    main()
