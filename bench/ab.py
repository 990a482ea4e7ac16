"""A/B of the engine: a git revision's against the work tree's, in CPU-seconds.

    .venv/bin/python bench/ab.py --baseline main              # 3 pairs, both legs
    .venv/bin/python bench/ab.py --baseline 9c2af90 --pairs 5 --legs het
    .venv/bin/python bench/ab.py --baseline HEAD --work-set prefix_cache=false

The revision's `src/` is exported with `git archive` into a temporary directory; each
side runs in a process of its own (bench/_ab_runner.py, the side's `src` first on
PYTHONPATH), started with `taskset -c CPU` on one torch thread. Pairs alternate which
side goes first (ABBA), so a machine that drifts slows both alike. Each process loads
the engine, warms it up, runs one leg and reports generated tokens per CPU-second of the
process (user + system: what the work cost, whatever else the machine runs), its peak
RSS, and then, as a second figure, wall-clock tokens per second of the same leg on two
cores with two threads (`--wall-cpus`, `--wall-cpus ''` for none). Printed: each side's
figures per leg, the ratio work ÷ baseline per pair (median, min-max), E3 (heterogeneous
÷ homogeneous) per side, and how many of the completions' texts the two sides share.

Legs (bench/_workloads.py, as engine_bench.py): `het` 256 heterogeneous requests (prompts
8-256 tokens, max_tokens 8-128, mixed temperature/top_p/penalties/stops/logprobs), `hom`
the same token counts in one shape (distinct prompts of the mean length, greedy), and on
request `lens`, het's own lengths with every request greedy (`--legs het,hom,lens` prints
E3's gap split into what the parameters and what the lengths cost). The model is
engine_bench's CPU model (4.5M-parameter Llama, vocab 4096) unless `--model DIR` names an
HF directory. `--set k=v` sets a ModelSpec field on both sides, `--base-set` /
`--work-set` on one. `--runs N` runs each leg N times in its process, one after the other,
as a worker runs consecutive files (the figures then cover all N; peak RSS is the
process's).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _workloads import homogeneous, make_requests, same_lengths

REPO = Path(__file__).resolve().parent.parent
RUNNER = Path(__file__).resolve().parent / "_ab_runner.py"
LEGS = {"het": "heterogeneous", "hom": "homogeneous", "lens": "same lengths, greedy"}


def export(rev: str, into: Path) -> tuple[str, Path]:
    """The revision's full hash and its `src` tree unpacked under `into`."""
    sha = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "archive", "--format=tar", sha, "src"], cwd=REPO, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return sha, into / "src"


def build_model(path: Path, kv_heads: int | None) -> Path:
    """engine_bench's CPU model, built by the work tree's code (either layout)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        from batchwright.engine.loading.demo import build_demo_model
    except ModuleNotFoundError:
        from batchwright.engine.loading.demo import build_demo_model

    built: Path = build_demo_model(
        path,
        hidden_size=256,
        layers=4,
        heads=4,
        kv_heads=kv_heads,
        intermediate_size=768,
        max_position_embeddings=1024,
        model_vocab_size=4096,
    )
    return built


def model_facts(path: Path) -> tuple[int, int]:
    """(vocabulary size, lowest EOS id) from the model's config."""
    cfg = json.loads((path / "config.json").read_text())
    gen = path / "generation_config.json"
    eos = cfg.get("eos_token_id")
    if eos is None and gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    eos_id = min(eos) if isinstance(eos, list) else int(eos)
    return int(cfg["vocab_size"]), eos_id


def parse_sets(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, _, raw = item.partition("=")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def run_side(src: Path, job: Path, cpu: int) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(src) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        ["taskset", "-c", str(cpu), sys.executable, str(RUNNER), str(job)],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"runner failed ({src}):\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    if Path(result["src"]).resolve() != src.resolve():
        raise SystemExit(f"runner imported batchwright from {result['src']}, not {src}")
    return result


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    med = statistics.median(values)
    return f"{fmt.format(med)} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--baseline", default="main", help="git revision (default main)")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument(
        "--legs", default="het,hom", help="het, hom (default both), lens (het's lengths, greedy)"
    )
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--rows", type=int, default=64, help="max_rows (default 64)")
    ap.add_argument("--cpu", type=int, default=0, help="core the measured run is pinned to")
    ap.add_argument("--wall-cpus", default="0,1", help="cores of the wall-clock run ('' none)")
    ap.add_argument("--model", type=Path, default=None, help="an HF model directory")
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--set", action="append", default=[], help="ModelSpec k=v, both sides")
    ap.add_argument("--base-set", action="append", default=[], help="k=v, baseline only")
    ap.add_argument("--work-set", action="append", default=[], help="k=v, work tree only")
    ap.add_argument(
        "--runs",
        type=int,
        default=1,
        help="times each process runs its leg, one after the other (a worker's files)",
    )
    ap.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bw-ab-"))
    sha, base_src = export(args.baseline, tmp)
    work_src = REPO / "src"
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "src"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    model = args.model or build_model(tmp / "model", args.kv_heads)
    vocab, eos = model_facts(model)
    bodies = make_requests(args.requests, vocab, eos, random.Random(0), scale=1.0)
    sets = {
        "het": bodies,
        "hom": homogeneous(bodies, eos, vocab),
        "lens": same_lengths(bodies, eos, vocab),
    }
    warmup = make_requests(4, vocab, eos, random.Random(1), scale=0.1)
    common = {"max_rows": args.rows, "max_batch_tokens": 4096, **parse_sets(args.set)}
    specs = {
        "base": {**common, **parse_sets(args.base_set)},
        "work": {**common, **parse_sets(args.work_set)},
    }
    srcs = {"base": base_src, "work": work_src}
    wall_cpus = [int(c) for c in args.wall_cpus.split(",") if c.strip()]
    legs = [leg.strip() for leg in args.legs.split(",") if leg.strip()]
    jobs: dict[tuple[str, str], Path] = {}
    for side in srcs:
        for leg in legs:
            job = tmp / f"{side}-{leg}.json"
            job.write_text(
                json.dumps(
                    {
                        "model": str(model),
                        "spec": specs[side],
                        "warmup": warmup,
                        "bodies": sets[leg],
                        "wall_cpus": wall_cpus,
                        "runs": args.runs,
                    }
                )
            )
            jobs[side, leg] = job
    print(
        f"baseline {args.baseline} = {sha[:10]}; work tree {head}"
        f"{' + uncommitted src' if dirty else ''}; "
        f"{args.pairs} pairs, cpu {args.cpu}, one thread; model {model}"
    )
    print(f"spec base {specs['base']}; work {specs['work']}")
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {k: [] for k in jobs}
    for i in range(args.pairs):
        order = ["base", "work"] if i % 2 == 0 else ["work", "base"]
        for leg in legs:
            for side in order:
                r = run_side(srcs[side], jobs[side, leg], args.cpu)
                runs[side, leg].append(r)
                wall = (
                    f", {r['tok_per_wall2_s']:.0f} tok/s wall x{r['wall_threads']}"
                    if "wall2_s" in r
                    else ""
                )
                print(
                    f"  pair {i + 1} {leg} {side}: {r['tokens']} tokens, {r['cpu_s']:.2f} "
                    f"CPU-s = {r['tok_per_cpu_s']:.0f} tok/CPU-s, "
                    f"peak RSS {r['peak_rss_mib']:.0f} MiB{wall}",
                    flush=True,
                )
    print()
    for leg in legs:
        base, work = runs["base", leg], runs["work", leg]
        print(f"{LEGS[leg]} ({base[0]['tokens']} tokens), median (min-max) over {args.pairs}:")
        for side, rs in (("baseline", base), ("work", work)):
            print(
                f"  {side:8s} tok/CPU-s {spread([r['tok_per_cpu_s'] for r in rs], '{:.0f}')}, "
                f"peak RSS {spread([r['peak_rss_mib'] for r in rs], '{:.0f}')} MiB, "
                f"minor faults {spread([r['minor_faults'] for r in rs], '{:.0f}')}"
            )
        ratio = [w["tok_per_cpu_s"] / b["tok_per_cpu_s"] for b, w in zip(base, work, strict=True)]
        print(f"  work ÷ baseline, tokens per CPU-second: {spread(ratio)}")
        if all("wall2_s" in r for r in base + work):
            walls = [
                w["tok_per_wall2_s"] / b["tok_per_wall2_s"] for b, w in zip(base, work, strict=True)
            ]
            print(
                f"  work ÷ baseline, wall-clock on {len(wall_cpus)} threads: {spread(walls)} "
                f"(baseline {spread([r['tok_per_wall2_s'] for r in base], '{:.0f}')}, "
                f"work {spread([r['tok_per_wall2_s'] for r in work], '{:.0f}')} tok/s)"
            )
        same = sum(base[0]["texts"][k] == work[0]["texts"].get(k) for k in base[0]["texts"])
        print(f"  completions with the same text on both sides: {same}/{len(base[0]['texts'])}")
    if "het" in legs and "hom" in legs:
        for side in ("base", "work"):
            e3 = [
                h["tok_per_cpu_s"] / o["tok_per_cpu_s"]
                for h, o in zip(runs[side, "het"], runs[side, "hom"], strict=True)
            ]
            print(f"E3 {side}: heterogeneous ÷ homogeneous, tokens per CPU-second: {spread(e3)}")
    # What E3's gap is made of: the parameters (het ÷ lens) and the lengths (lens ÷ hom).
    for num, den, what in (("het", "lens", "the parameters"), ("lens", "hom", "the lengths")):
        if num in legs and den in legs:
            for side in ("base", "work"):
                part = [
                    a["tok_per_cpu_s"] / b["tok_per_cpu_s"]
                    for a, b in zip(runs[side, num], runs[side, den], strict=True)
                ]
                print(f"{side}: {num} ÷ {den} ({what}), tokens per CPU-second: {spread(part)}")
    if args.json:
        args.json.write_text(
            json.dumps({f"{s}/{leg}": rs for (s, leg), rs in runs.items()}, indent=1)
        )


if __name__ == "__main__":
    main()
