"""Interrupt `batchwright run` at about half a file and run it again, against a full run.

    python bench/run_resume.py [--lines 30000] [--max-tokens 4] [--at 0.5]

Times three subprocesses of the real command on one machine, side by side: a full run of
the file, a run of a copy interrupted with SIGINT once the state database holds `--at` of
the lines, and the same command again. Prints the figures and checks that the resumed
output has every custom_id exactly once, in input order, with the same completions as the
full run (greedy decoding). The demo model and the attention kernel are built first, out
of the timings.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from batchwright.runs.state import RunState


def write_input(path: Path, lines: int, max_tokens: int) -> None:
    words = ["sea", "river", "mountain", "town", "model", "batch", "story", "coast"]
    with path.open("w") as out:
        for i in range(lines):
            prompt = f"Question {i}: tell me about the {words[i % len(words)]} and the {i % 97}"
            body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
            out.write(json.dumps(line) + "\n")


def command(path: Path) -> list[str]:
    return [sys.executable, "-m", "batchwright.cli", "run", str(path), "--quiet"]


def cpu_seconds() -> float:
    """CPU time of the finished children so far: on a shared machine wall time mostly
    measures the neighbours, CPU time the run."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(path: Path, env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    start = time.monotonic()
    done = subprocess.run(command(path), env=env, capture_output=True, text=True, check=False)
    return time.monotonic() - start, done


def finished_lines(database: Path) -> int:
    if not database.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=5) as conn:
            row = conn.execute(
                "SELECT count(*) FROM batch_requests WHERE state IN ('succeeded', 'failed')"
            ).fetchone()
    except sqlite3.OperationalError:  # tables not created yet
        return 0
    return int(row[0])


def interrupted(path: Path, env: dict[str, str], target: int) -> tuple[float, int, str, int]:
    database = RunState(Path(env["BATCHWRIGHT_HOME"]), path).database
    start = time.monotonic()
    proc = subprocess.Popen(command(path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    while finished_lines(database) < target and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stopped = time.monotonic()
    _, err = proc.communicate()
    return (
        time.monotonic() - start,
        proc.returncode,
        err.decode(),
        int((time.monotonic() - stopped) * 1000),
    )


def outputs(path: Path) -> list[tuple[str, str]]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return [(r["custom_id"], r["response"]["body"]["choices"][0]["text"]) for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=30_000)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--at", type=float, default=0.5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bw-resume-bench-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWRIGHT_")}
    env["BATCHWRIGHT_HOME"] = os.environ.get("BATCHWRIGHT_HOME", str(work / "home"))

    warm = work / "warm.jsonl"
    write_input(warm, 4, args.max_tokens)
    timed(warm, env)  # builds the demo model and the kernel if needed

    full, part = work / "full.jsonl", work / "part.jsonl"
    write_input(full, args.lines, args.max_tokens)
    write_input(part, args.lines, args.max_tokens)
    cores = os.cpu_count()
    print(f"{args.lines} lines, max_tokens {args.max_tokens}, demo model, CPU, {cores} cores")

    cpu = cpu_seconds()
    t_full, done = timed(full, env)
    assert done.returncode == 0, done.stderr[-2000:]
    c_full, cpu = cpu_seconds() - cpu, cpu_seconds()
    print(f"full run:          {t_full:7.1f} s wall {c_full:7.1f} s CPU")

    t_first, code, err, stop_ms = interrupted(part, env, int(args.lines * args.at))
    c_first, cpu = cpu_seconds() - cpu, cpu_seconds()
    message = [ln for ln in err.splitlines() if ln.startswith("interrupted")]
    print(f"interrupted run:   {t_first:7.1f} s wall {c_first:7.1f} s CPU  exit {code}, "
          f"stopped {stop_ms} ms after SIGINT")  # fmt: skip
    print(f"  {message[0] if message else err[-500:]}")

    t_again, done = timed(part, env)
    assert done.returncode == 0, done.stderr[-2000:]
    c_again = cpu_seconds() - cpu
    wall, cpu_ratio = t_again / t_full, c_again / c_full
    print(f"run again:         {t_again:7.1f} s wall {c_again:7.1f} s CPU  = "
          f"{wall:.2f} x the full run's wall time, {cpu_ratio:.2f} x its CPU")  # fmt: skip

    a = outputs(full.with_name("full.output.jsonl"))
    b = outputs(part.with_name("part.output.jsonl"))
    ids = [cid for cid, _ in b]
    assert ids == [f"r{i}" for i in range(args.lines)], "custom_ids not once each in input order"
    same = sum(x == y for x, y in zip(a, b, strict=True))
    print(f"resumed output: {len(ids)} lines, each custom_id once, in order; "
          f"{same} of {len(a)} completions identical to the full run")  # fmt: skip
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
