"""How long `batchwright` takes to start: the import of `batchwright.cli`, and the first
(cold) and second (warm) run of the README's example, so that start-up cannot creep.

    PYTHONPATH=src python bench/startup.py [--imports 5] [--warm 2] [--no-cold]

- import: `import batchwright.cli` in a fresh interpreter (median of --imports), beside the
  bare interpreter's start, and whether openai / sqlalchemy / torch came with it;
- cold: `batchwright run examples/completions.jsonl` with a BATCHWRIGHT_HOME and a
  TORCH_EXTENSIONS_DIR of its own, both empty, so it builds the demo model and the CPU
  kernels (the build times are the ones the run prints); the shared ~/.cache ones are never
  touched;
- warm: the same command again, --warm times (both built, a fresh run state each time).

Wall and CPU seconds of each child: on a shared machine wall time also measures the
neighbours, CPU time the command.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "completions.jsonl"
WATCHED = ("openai", "sqlalchemy", "torch", "transformers")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(args: list[str], env: dict[str, str]) -> tuple[float, float, str, str]:
    """Wall seconds, CPU seconds, stdout and stderr of one child; fails loudly."""
    cpu0, start = _cpu(), time.monotonic()
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    wall, cpu = time.monotonic() - start, _cpu() - cpu0
    if done.returncode != 0:
        sys.exit(f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
    return wall, cpu, done.stdout, done.stderr


def import_figures(env: dict[str, str], repeats: int) -> None:
    probe = (
        "import sys, time\n"
        "t = time.perf_counter()\n"
        "import batchwright.cli\n"
        "print(time.perf_counter() - t)\n"
        f"print(','.join(m for m in {WATCHED!r} if m in sys.modules))\n"
    )
    bare = [timed([sys.executable, "-c", "pass"], env)[0] for _ in range(repeats)]
    inner, walls, loaded = [], [], ""
    for _ in range(repeats):
        wall, _, out, _ = timed([sys.executable, "-c", probe], env)
        seconds, loaded = [*out.splitlines(), ""][:2]
        inner.append(float(seconds))
        walls.append(wall)
    print(f"import batchwright.cli   {statistics.median(inner):6.2f} s  (median of {repeats})")
    print(
        f"  interpreter + import   {statistics.median(walls):6.2f} s wall"
        f"  (bare interpreter {statistics.median(bare):.2f} s)"
    )
    print(f"  heavy modules loaded   {loaded or 'none'}  (of {', '.join(WATCHED)})")


def run_example(workdir: Path, env: dict[str, str], label: str) -> float:
    data = workdir / "completions.jsonl"
    shutil.copyfile(EXAMPLE, data)
    args = [sys.executable, "-m", "batchwright.cli", "run", str(data), "--quiet"]
    wall, cpu, _, out = timed(args, env)
    builds = ", ".join(
        f"{what} {seconds} s" for what, seconds in re.findall(r"built (.+?) in (\d+) s", out)
    )
    print(f"{label:<24} {wall:6.2f} s wall  {cpu:6.2f} s CPU" + (f"  ({builds})" if builds else ""))
    return wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--imports", type=int, default=5, help="imports timed (median)")
    parser.add_argument("--warm", type=int, default=2, help="warm runs after the cold one")
    parser.add_argument("--no-cold", action="store_true", help="warm runs only (shared home)")
    opts = parser.parse_args()
    env = dict(os.environ)
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    import_figures(env, opts.imports)
    workdir = Path(tempfile.mkdtemp(prefix="bw-startup-"))
    try:
        if not opts.no_cold:
            # Our own, empty: the shared caches are never read or removed here.
            env["BATCHWRIGHT_HOME"] = str(workdir / "home")
            env["TORCH_EXTENSIONS_DIR"] = str(workdir / "torch_extensions")
            cold = run_example(workdir, env, "first run (cold)")
        warm = [run_example(workdir, env, f"warm run {i + 1}") for i in range(opts.warm)]
        if not opts.no_cold and warm:
            print(f"cold / warm              {cold / statistics.median(warm):6.2f}x")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
