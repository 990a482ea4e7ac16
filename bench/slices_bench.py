"""What a run's first step costs when the device state outlives the run (issue 31 item 2).

A file done in work slices (`batchwright run`'s slices, a worker's consecutive leases
without an engine host) is one engine run per slice. Two ways, alternating, in one
process on one pinned thread, timed in CPU-seconds:

- kept: the engine's runner (KV pools, prefix index, slots, sampler state, graphs) is
  built at the first run and kept, as the engine does now;
- rebuilt: `engine.new_runner()` before each slice, as every run did before.

Per slice it prints the CPU time from `engine.run` to the end of its first step (the
first forward's end: device state built if need be, lines read, the prompts admitted and
prefilled) and the median of the steady steps after it (one per forward; decode rows
only), and the prompt tokens the first step prefilled (cached ones are not). The lines of
every slice share a prefix with the first slice's, so a kept prefix index saves the later
slices' prefills too.

    .venv/bin/python bench/slices_bench.py [--slices 3] [--lines 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from engine_bench import build_cpu_model

from batchwright.engine.engine import Engine
from batchwright.engine.requests.observer import Observer
from batchwright.engine.requests.types import GenRequest
from batchwright.registry import ModelSpec
from batchwright.serving.lines import prepared


class Steps(Observer):
    """CPU time at the end of each forward, and the prompt tokens it prefilled."""

    def __init__(self) -> None:
        self.ends: list[tuple[float, int]] = []

    def forward(self, seconds: float, prompt_tokens: int) -> None:
        self.ends.append((time.process_time(), prompt_tokens))


def slice_lines(
    prefix: list[int], n: int, vocab: int, eos: int, rng: random.Random
) -> list[GenRequest]:
    out = []
    for i in range(n):
        tail = [rng.randrange(5, vocab) for _ in range(rng.randint(4, 16))]
        body = {
            "model": "bench",
            "prompt": prefix + tail,
            "max_tokens": 24,
            "temperature": 0.0,
            "logit_bias": {str(eos): -100},  # every line generates max_tokens
        }
        out.append(GenRequest(i, body))
    return out


def run_slice(
    engine: Engine, steps: Steps, lines: list[GenRequest], rebuild: bool
) -> tuple[float, float, int]:
    """(CPU seconds to the end of the first step, median CPU seconds of a decode step,
    prompt tokens the first step prefilled); `rebuild`: the device state built afresh
    first, inside the time, as every run did before."""
    steps.ends.clear()
    source = prepared(engine, lines)  # each line prepared as the engine reads it
    start = time.process_time()
    if rebuild:
        engine.new_runner()
    for result in engine.run(source):
        assert result.status_code == 200, result.error
    (first, prefilled), rest = steps.ends[0], steps.ends[1:]
    decode = [b - a for (a, _), (b, p) in zip(steps.ends, rest, strict=False) if p == 0]
    return first - start, statistics.median(decode), prefilled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slices", type=int, default=3)
    ap.add_argument("--lines", type=int, default=64, help="lines per slice")
    ap.add_argument("--rounds", type=int, default=3, help="kept/rebuilt pairs, alternating")
    ap.add_argument("--cpu", type=int, default=0, help="core to pin to")
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    path = build_cpu_model(Path(tempfile.mkdtemp(prefix="bw-slices-")) / "bench")
    engine = Engine.load(ModelSpec(name="bench", path=path, max_rows=64, max_batch_tokens=4096))
    steps = Steps()
    engine.observe(steps)
    vocab, eos = engine.lm.vocab_size, min(engine.lm.eos_ids)
    rng = random.Random(0)
    prefix = [rng.randrange(5, vocab) for _ in range(192)]
    warm = slice_lines(prefix[:8], 8, vocab, eos, random.Random(1))
    run_slice(engine, steps, warm, True)  # kernel builds, allocator, first-call costs
    figures: dict[str, list[list[tuple[float, float, int]]]] = {"kept": [], "rebuilt": []}
    for r in range(args.rounds):
        for mode in ("kept", "rebuilt") if r % 2 == 0 else ("rebuilt", "kept"):
            got = []
            for s in range(args.slices):
                # Each file starts cold; then its slices keep the state, or rebuild it.
                rebuild = s == 0 or mode == "rebuilt"
                lines = slice_lines(prefix, args.lines, vocab, eos, random.Random(100 + s))
                got.append(run_slice(engine, steps, lines, rebuild))
            figures[mode].append(got)
    print(
        f"{args.lines} lines a slice, {args.slices} slices, {args.rounds} rounds; "
        f"CPU ms, median over rounds (min-max); one thread on cpu {args.cpu}"
    )
    for mode, rounds in figures.items():
        for s in range(args.slices):
            firsts = [1e3 * rnd[s][0] for rnd in rounds]
            steady = [1e3 * rnd[s][1] for rnd in rounds]
            prefilled = [rnd[s][2] for rnd in rounds]
            print(
                f"  {mode:7s} slice {s + 1}: first step {statistics.median(firsts):7.1f} "
                f"({min(firsts):.1f}-{max(firsts):.1f}), prompt tokens prefilled "
                f"{statistics.median(prefilled):.0f}; steady decode step "
                f"{statistics.median(steady):5.2f} ({min(steady):.2f}-{max(steady):.2f})"
            )


if __name__ == "__main__":
    main()
