"""Shared-prefix reuse through the service: the same speed-up as the engine alone?

The shared-prefix file of prefix_bench.py (i) (lines sharing one 384-token prefix plus
8-32 unique tokens, greedy, max_tokens 32) on the engine benchmark's CPU model, four ways:
the engine alone with reuse off and on, and the worker's service path (validation records
prefix keys, fair-share claims hand lines out grouped by prefix, read-ahead, the writer
thread, results in a throwaway Postgres database) with reuse off and on. Prints each
time, the two speed-ups and their ratio (target: the service's speed-up within 10 % of the
engine's). Rounds interleave the four and each keeps its best.

    PYTHONPATH=src python bench/prefix_service.py [--lines 256] [--rounds 2]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import done_lines, submit, temp_database
from engine_bench import build_cpu_model
from prefix_bench import lines as prefix_lines
from prefix_bench import run as run_engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import torch

    from batchwright import control
    from batchwright.engine.engine import Engine
    from batchwright.registry import ModelSpec, Registry
    from batchwright.worker.generation import runner

    torch.set_grad_enabled(False)
    home = Path(tempfile.mkdtemp(prefix="bw-prefix-service-"))
    path = build_cpu_model(home / "models" / "bench")
    base: dict[str, Any] = {"name": "bench", "path": path, "max_rows": 64}
    specs = {
        reuse: ModelSpec(**base, max_batch_tokens=4096, prefix_cache=reuse)
        for reuse in (False, True)
    }
    engines = {reuse: Engine.load(spec) for reuse, spec in specs.items()}
    vocab, eos = engines[True].lm.vocab_size, min(engines[True].lm.eos_ids)
    rng = random.Random(0)
    bodies = prefix_lines(
        [[rng.randrange(1, vocab) for _ in range(384)]], args.lines, vocab, eos, rng, 32
    )
    file = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
        for i, body in enumerate(bodies)
    ]
    for reuse in (False, True):
        run_engine(engines[reuse], bodies[:8])  # warm-up: kernel build, allocator

    def service(reuse: bool) -> float:
        with temp_database(home=str(home), work_slice_seconds="3600"):
            registry = Registry(models={"bench": specs[reuse]})
            # A worker's lease process starts once, not inside the timing.
            runner.process("bench", registry, lambda _: engines[reuse])
            batch_id = submit("bench", file)
            control.validate_batch(batch_id, registry)
            start = time.perf_counter()
            runner.process("bench", registry, lambda _: engines[reuse])
            elapsed = time.perf_counter() - start
            assert done_lines(batch_id) == len(file), done_lines(batch_id)
            return elapsed

    times: dict[str, list[float]] = {
        k: [] for k in ("engine off", "engine on", "service off", "service on")
    }
    for r in range(args.rounds):
        for reuse in (False, True):
            label = "on" if reuse else "off"
            times[f"engine {label}"].append(run_engine(engines[reuse], bodies)[0])
            times[f"service {label}"].append(service(reuse))
        print(
            f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()),
            flush=True,
        )
    best = {k: min(v) for k, v in times.items()}
    engine_x = best["engine off"] / best["engine on"]
    service_x = best["service off"] / best["service on"]
    print(
        f"{args.lines} lines sharing a 384-token prefix, max_tokens 32, CPU, best of {args.rounds}"
    )
    for k, v in best.items():
        print(f"{k:12s} {v:7.2f} s")
    print(f"speed-up from reuse, engine alone:  {engine_x:5.2f}x")
    print(f"speed-up from reuse, service path:  {service_x:5.2f}x")
    print(f"service speed-up / engine speed-up: {service_x / engine_x:5.2f}  (target >= 0.90)")


if __name__ == "__main__":
    main()
