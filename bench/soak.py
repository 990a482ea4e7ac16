"""A soak (issue 33, item 13): batches and online load in turn for a long while, the
memory of the API process and of the worker's process tree printed over time.

The real service on this machine (bench/online_bench.py's Stack). Each round: a batch
(--batch-lines lines) to its end, then a burst of online requests (--online streams at
once, each several requests: streamed and not, chat, a few clients that leave early, a few
refused ones with long model names); between rounds the RSS of the API and of the worker
tree (worker, lease process, control worker) is sampled. At the end: the series, and the
growth over the second half of the run against the first (a leak keeps growing; a process
that levels off does not).

    PYTHONPATH=src python bench/soak.py [--minutes 45] [--batch-lines 400] [--online 32]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from online_bench import EOS_BAN, Stack, batch_file, run_batch

MIB = 1024 * 1024


def rss(stack: Stack) -> tuple[float, float]:
    """RSS in MiB of the API process and of the worker with everything it started."""
    out = []
    for proc in stack.procs[:2]:
        p = psutil.Process(proc.pid)
        tree = [p, *p.children(recursive=True)]
        total = 0
        for q in tree:
            with contextlib.suppress(psutil.Error):
                total += q.memory_info().rss
        out.append(total / MIB)
    return out[0], out[1]


async def burst(url: str, key: str, clients: int, rng: random.Random) -> dict[str, int]:
    seen: dict[str, int] = {}
    headers = {"Authorization": f"Bearer {key}"}

    async def one(client: httpx.AsyncClient, i: int) -> None:
        for j in range(4):
            kind = (i + j) % 8
            body: dict[str, Any] = {"model": "demo", "prompt": f"soak {i} {j}", "max_tokens": 24,
                                    "logit_bias": EOS_BAN}  # fmt: skip
            path = "/v1/completions"
            if kind == 1:
                body = {"model": "demo", "messages": [{"role": "user", "content": f"hi {i}"}],
                        "max_tokens": 16}  # fmt: skip
                path = "/v1/chat/completions"
            if kind == 2:
                body["model"] = "nope-" + "x" * rng.randint(100, 5000)
            try:
                if kind in (3, 4):
                    body |= {"stream": True, "stream_options": {"include_usage": True}}
                    async with client.stream("POST", path, json=body) as r:
                        async for n, _ in _enumerate(r.aiter_lines()):
                            if kind == 4 and n == 3:
                                break  # a client that leaves mid-stream
                    status = r.status_code
                else:
                    status = (await client.post(path, json=body)).status_code
            except httpx.HTTPError as exc:
                status = -1
                seen[type(exc).__name__] = seen.get(type(exc).__name__, 0) + 1
            seen[str(status)] = seen.get(str(status), 0) + 1

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300) as client:
        await asyncio.gather(*(one(client, i) for i in range(clients)))
    return seen


async def _enumerate(it: Any) -> Any:
    n = 0
    async for item in it:
        yield n, item
        n += 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=45)
    ap.add_argument("--batch-lines", type=int, default=400)
    ap.add_argument("--online", type=int, default=32)
    ap.add_argument("--max-rows", type=int, default=32)
    args = ap.parse_args()

    from batchwright.engine.loading.demo import build_demo_model

    home = Path(tempfile.mkdtemp(prefix="bw-soak-home-"))
    build_demo_model(home / "models" / "demo")
    stack = Stack(home, args.max_rows)
    rng = random.Random(5)
    series: list[tuple[float, float, float]] = []
    start = time.monotonic()
    end = start + args.minutes * 60
    try:
        data = batch_file(args.batch_lines, 24)
        rounds = 0
        statuses: dict[str, int] = {}
        while time.monotonic() < end:
            run = run_batch(stack, data)
            seen = asyncio.run(burst(stack.url, stack.key, args.online, rng))
            for k, v in seen.items():
                statuses[k] = statuses.get(k, 0) + v
            rounds += 1
            api, worker = rss(stack)
            minute = (time.monotonic() - start) / 60
            series.append((minute, api, worker))
            print(
                f"{minute:6.1f} min  round {rounds:3d}  API {api:6.1f} MiB  worker tree "
                f"{worker:6.1f} MiB  (batch {run.lines} lines, errors {run.errors})",
                flush=True,
            )
        print(f"online answers over the run: {statuses}")
        half = len(series) // 2
        if half >= 2:
            for name, col in (("API", 1), ("worker tree", 2)):
                first = series[half - 1][col] - series[0][col]
                second = series[-1][col] - series[half - 1][col]
                print(
                    f"{name}: {series[0][col]:.0f} -> {series[half - 1][col]:.0f} -> "
                    f"{series[-1][col]:.0f} MiB (first half +{first:.1f}, second half "
                    f"+{second:.1f}; peak {max(r[col] for r in series):.0f})"
                )
    finally:
        stack.close()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
