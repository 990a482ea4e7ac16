"""Shared-prefix reuse: the engine with and without it, side by side in one run.

(i)   lines sharing one long prefix plus a few unique tokens: reuse on against reuse off,
      and against the same lines without the prefix;
(ii)  several different prefixes, lines shuffled: grouped by prefix (what claims hand a
      worker) against file order, reuse on, with a KV budget that holds the running rows
      and about two prefixes (the regime where grouping matters: long prefixes, a full
      GPU);
(iii) engine_bench.py's mix with no shared prefixes: reuse on against off (the index's
      overhead), with the peak RSS after each.

`--overhead PAIRS` runs only (iii), as PAIRS interleaved pairs of runs in one process
(on then off, then off then on, ...), and prints the mean time ratio with a 95 %
bootstrap interval: the prefix cache is on by default, so its cost on files that share
nothing must be told apart from this machine's noise, not read off one pair of runs.

    .venv/bin/python bench/prefix_bench.py               # CPU, the engine benchmark's model
    .venv/bin/python bench/prefix_bench.py --quick       # smoke run
    .venv/bin/python bench/prefix_bench.py --overhead 20 # (iii) alone, 20 interleaved pairs
    .venv/bin/python bench/prefix_bench.py --gpu         # Qwen2.5-0.5B-shaped model, bf16 on CUDA
"""

from __future__ import annotations

import argparse
import math
import random
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_bench import build_cpu_model, build_gpu_model, make_requests, sync

from batchwright.engine.engine import Engine
from batchwright.engine.requests.types import GenRequest
from batchwright.registry import ModelSpec
from batchwright.serving.lines import serve


def run(engine: Engine, bodies: list[dict[str, Any]]) -> tuple[float, int, int]:
    """Seconds, generated tokens and prompt tokens served from the prefix cache."""
    reqs = [GenRequest(i, b) for i, b in enumerate(bodies)]
    # Each run starts cold, as a run did before device state outlived runs: the prefix
    # cache then holds only what this run put there.
    engine.new_runner()
    sync()
    t = time.perf_counter()
    tokens = cached = 0
    for res in serve(engine, reqs):
        assert res.status_code == 200, res.error
        assert res.completion is not None
        tokens += res.completion_tokens
        cached += res.cached_tokens
    sync()
    return time.perf_counter() - t, tokens, cached


def lines(
    prefixes: list[list[int]], n: int, vocab: int, eos: int, rng: random.Random, max_tokens: int
) -> list[dict[str, Any]]:
    """`n` greedy lines, line i on prefix i % len(prefixes), plus 8-32 unique tokens."""
    out = []
    for i in range(n):
        tail = [rng.randrange(1, vocab) for _ in range(rng.randint(8, 32))]
        out.append(
            {
                "model": "bench",
                "prompt": prefixes[i % len(prefixes)] + tail,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "logit_bias": {str(eos): -100},  # every line generates max_tokens
            }
        )
    return out


def overhead(on: Engine, off: Engine, mix: list[dict[str, Any]], pairs: int) -> None:
    """(iii) alone: `pairs` interleaved pairs, the order alternating so that a drift of the
    machine's speed over a pair falls on each side equally often."""
    ratios = []
    for i in range(pairs):
        first, second = (on, off) if i % 2 == 0 else (off, on)
        a, b = run(first, mix)[0], run(second, mix)[0]
        t_on, t_off = (a, b) if first is on else (b, a)
        ratios.append(t_on / t_off)
        print(f"  pair {i + 1}: on {t_on:.2f}s, off {t_off:.2f}s, {t_on / t_off - 1:+.1%}")
    logs = [math.log(r) for r in ratios]
    mean = math.exp(statistics.fmean(logs)) - 1
    boot = random.Random(0)
    means = sorted(statistics.fmean(boot.choices(logs, k=len(logs))) for _ in range(10_000))
    low, high = (math.exp(means[int(q * len(means))]) - 1 for q in (0.025, 0.975))
    print(
        f"(iii) reuse on vs off, no shared prefixes, {pairs} interleaved pairs: "
        f"{mean:+.1%} time (95% interval {low:+.1%} to {high:+.1%}; median "
        f"{statistics.median(ratios) - 1:+.1%}; target <= +3%)"
    )


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="64 lines, shorter prefixes")
    ap.add_argument("--gpu", action="store_true", help="Qwen2.5-0.5B-shaped model on CUDA")
    ap.add_argument("--lines", type=int, default=None, help="lines per scenario (default 256)")
    ap.add_argument("--rows", type=int, default=None, help="max_rows (default 64; GPU 256)")
    ap.add_argument("--repeat", type=int, default=None, help="rounds, best kept (CPU: 2)")
    ap.add_argument(
        "--overhead", type=int, default=0, metavar="PAIRS", help="only (iii), PAIRS interleaved"
    )
    args = ap.parse_args()

    torch.set_grad_enabled(False)
    rng = random.Random(0)
    tmp = Path(tempfile.mkdtemp(prefix="bw-prefix-bench-"))
    n = args.lines or (64 if args.quick else 256)
    long_prefix, few_prefix = (96, 64) if args.quick else (384, 256)
    if args.gpu:
        rows = args.rows or 256
        path = build_gpu_model(tmp / "qwen-shape")
        base: dict[str, Any] = {"path": path, "device": "cuda", "max_rows": rows}
    else:
        rows = args.rows or 64
        path = build_cpu_model(tmp / "bench")
        base = {"path": path, "max_rows": rows, "max_batch_tokens": 4096}

    def engine(**spec: Any) -> Engine:
        return Engine.load(ModelSpec(name="bench", **{**base, "prefix_cache": True, **spec}))

    on, off = engine(), engine(prefix_cache=False)
    vocab, eos = on.lm.vocab_size, min(on.lm.eos_ids)
    bs = on.runner.cache.block_size
    # (ii)'s KV budget: every row's own blocks (the blocks past its prefix's: its tail of
    # at most 32 tokens and 32 generated) plus two prefixes.
    own = (-(-(few_prefix + 64) // bs) - few_prefix // bs) * bs
    tight = engine(kv_tokens=rows * own + 2 * few_prefix)
    model = on.lm.model
    print(
        f"model: {type(model).__name__} {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
        f"params, {on.lm.dtype} on {on.lm.device}, max_rows {rows}, block size {bs}, "
        f"attention {on.attention_backend}, torch threads {torch.get_num_threads()}",
        flush=True,
    )

    def toks(k: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(k)]

    shared = lines([toks(long_prefix)], n, vocab, eos, rng, 32)
    bare = [{**b, "prompt": b["prompt"][long_prefix:]} for b in shared]
    grouped = lines([toks(few_prefix) for _ in range(8)], n, vocab, eos, rng, 32)
    grouped.sort(key=lambda b: b["prompt"][:few_prefix])  # stable: one prefix after another
    shuffled = grouped[:]
    random.Random(1).shuffle(shuffled)
    mix = make_requests(n, vocab, eos, random.Random(0), scale=0.5 if args.quick else 1.0)

    systems: dict[str, Callable[[], tuple[float, int, int]]] = {
        "(i) shared prefix, reuse off": lambda: run(off, shared),
        "(i) shared prefix, reuse on": lambda: run(on, shared),
        "(i) same lines without the prefix": lambda: run(on, bare),
        "(ii) 8 prefixes, file order": lambda: run(tight, shuffled),
        "(ii) 8 prefixes, grouped": lambda: run(tight, grouped),
        "(iii) engine_bench mix, reuse off": lambda: run(off, mix),
        "(iii) engine_bench mix, reuse on": lambda: run(on, mix),
    }
    run(on, lines([toks(40)], 4, vocab, eos, rng, 4))  # warm-up (kernel build, allocator)
    run(off, lines([toks(40)], 4, vocab, eos, rng, 4))
    if args.overhead:
        overhead(on, off, mix, args.overhead)
        return
    # Rounds interleave the systems and each keeps its best time, so a shared machine's
    # noise slows every system alike.
    repeat = args.repeat or (1 if args.quick or args.gpu else 2)
    times: dict[str, list[float]] = {k: [] for k in systems}
    info: dict[str, tuple[int, int]] = {}
    peak: dict[str, float] = {}
    for r in range(repeat):
        for name, fn in systems.items():
            sec, tokens, cached = fn()
            times[name].append(sec)
            info[name] = (tokens, cached)
            peak.setdefault(name, rss_mib())
            print(f"  round {r + 1}: {name}: {sec:.2f}s", flush=True)
    best = {k: min(v) for k, v in times.items()}
    for name in systems:
        tokens, cached = info[name]
        print(
            f"{name}: {best[name]:.2f}s, {tokens / best[name]:.0f} tok/s, cached prompt "
            f"tokens {cached} (runs: {', '.join(f'{t:.2f}' for t in times[name])} s; "
            f"peak RSS after its first run {peak[name]:.0f} MiB)"
        )
    names = list(systems)
    print(f"(i)   reuse on vs off:          {best[names[0]] / best[names[1]]:5.2f}x  (target >= 3)")
    print(
        f"(i)   reuse on vs no prefix:    {best[names[1]] / best[names[2]]:5.2f}x slower "
        "(target <= 1.3)"
    )
    print(
        f"(ii)  grouped vs file order:    {best[names[3]] / best[names[4]]:5.2f}x  (target >= 1.5)"
    )
    print(
        f"(iii) reuse on vs off, no shared prefixes: "
        f"{best[names[6]] / best[names[5]] - 1:+.1%} time (target <= +3%)"
    )
    print(f"peak RSS: {rss_mib():.0f} MiB")
    if args.gpu:
        print(f"peak GPU memory: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
