"""Online completions beside batches, measured (issue 23, item 6).

The real service on this machine: `batchwright serve`, one `batchwright worker --models
demo` (its engine host serves batch leases and online requests in one loop), a throwaway
Postgres database and a queue of its own on Redis (BW_TEST_PG, BW_TEST_REDIS), the demo
model. Clients stream through the endpoint over loopback (httpx, SSE). One run prints:

(i) idle
  - one stream: time to first token (TTFT) and mean inter-token latency (ITL);
  - 32 concurrent streams: the endpoint's tokens/s against the engine alone on the same
    requests (Engine.run in this process, the worker's CPU threads): target >= 0.8x;
  - 16 concurrent streams, closed loop (each client sends its next request when its last
    one ends): TTFT p50 / p99, the reference for (ii).
(ii) under a saturating batch (--batch-lines, 20,000 by default)
  - the batch alone: its lines/s and tokens/s, and the worker's mean engine step (on a CPU
    host what one full decode step of max_rows rows costs, beside the TTFTs);
  - the same batch again with the 16 closed-loop streams running from its first finished
    line to its last: their TTFT p50 / p99 against idle (targets <= 2x and <= 4x), the
    batch's throughput against alone (it may drop by the online tokens' share plus at most
    10 %), its output line for line against the run alone, lines lost or written twice (0),
    and the batch lines the worker preempted.

    PYTHONPATH=src python bench/online_bench.py [--batch-lines 20000] [--aiperf BIN]

With --aiperf (AIPerf from PyPI, installed apart: it pins orjson, psutil and rich below
the project's, e.g. `python3.11 -m venv /tmp/aiperf && /tmp/aiperf/bin/pip install
aiperf`), the same runs are recorded with it too, against the same endpoint and the demo
model's tokenizer folder (loopback only):

    aiperf profile --model demo --url http://127.0.0.1:PORT --endpoint-type completions \
      --streaming --tokenizer DEMO_MODEL_DIR --use-server-token-count \
      --use-legacy-max-tokens --synthetic-input-tokens-mean 16 --output-tokens-mean 64 \
      --extra-inputs '{"logit_bias": {"0": -100}}' --api-key KEY --ui-type none \
      --concurrency C (--request-count N | --benchmark-duration S) --artifact-dir DIR

(C, N: 1 and 8, 32 and 32, 16 and 64 idle; 16 for 80 % of the batch's time alone while
the batch runs again). `--use-legacy-max-tokens`: the endpoint takes `max_tokens`, as
OpenAI's completions do; the logit_bias keeps EOS away, so every request runs its tokens.
A shared machine moves between phases: read the ratios with that in mind.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

PG_ADMIN = os.environ.get("BW_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS = os.environ.get("BW_TEST_REDIS", "redis://127.0.0.1:6379/7")
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "seven", "quiet"]
EOS_BAN = {"0": -100}  # the demo tokenizer's <|endoftext|>: every stream runs max_tokens


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24)))


# --- the service ------------------------------------------------------------------------


class Stack:
    """Database, API and one worker; stopped (and the database dropped) at the end."""

    def __init__(self, home: Path, max_rows: int, **settings: str) -> None:
        import psycopg

        self.home = home
        self.db = f"bw_bench_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{self.db}"')
        self.port, self.metrics_port = _free_port(), _free_port()
        spec = {"path": str(home / "models" / "demo"), "max_rows": max_rows}
        self.env = {
            **os.environ,
            "BATCHWRIGHT_DATABASE_URL": PG_ADMIN.rsplit("/", 1)[0] + "/" + self.db,
            "BATCHWRIGHT_BROKER_URL": REDIS,
            "BATCHWRIGHT_QUEUE": f"bw-bench-{uuid.uuid4().hex[:8]}",
            "BATCHWRIGHT_HOME": str(home),
            "BATCHWRIGHT_MODELS": json.dumps({"models": {"demo": spec}}),
            # One slice for the whole batch: the bench measures the loop, not re-dispatch.
            "BATCHWRIGHT_WORK_SLICE_SECONDS": "3600",
            **{f"BATCHWRIGHT_{k}": v for k, v in settings.items()},
        }
        self.logs = Path(tempfile.mkdtemp(prefix="bw-online-bench-"))
        self.procs: list[subprocess.Popen[bytes]] = []
        self._cli("db", "upgrade")
        self.key = self._cli("keys", "create", "--project", "bench").strip().splitlines()[-1]
        self._spawn("api", "serve", "--port", str(self.port))
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait(lambda: httpx.get(self.url + "/healthz", timeout=1).status_code == 200)
        self._spawn(
            "worker", "worker", "--models", "demo", WORKER_METRICS_PORT=str(self.metrics_port)
        )
        self._wait(lambda: self.metric("batchwright_worker_model_loaded") == 1, timeout=300)

    def _cli(self, *args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "batchwright.cli", *args],
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout

    def _spawn(self, name: str, *args: str, **env: str) -> None:
        extra = {f"BATCHWRIGHT_{k}": v for k, v in env.items()}
        log = (self.logs / f"{name}.log").open("wb")
        self.procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "batchwright.cli", *args],
                env={**self.env, **extra},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    @staticmethod
    def _wait(condition: Any, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if condition():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("the service did not start (logs: see the bench's temp folder)")

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of the API and of the worker (with its lease process)."""
        import psutil

        out = {}
        for name, proc in zip(("api", "worker"), self.procs, strict=True):
            p = psutil.Process(proc.pid)
            ps = [p, *p.children(recursive=True)]
            out[name] = sum(sum(x.cpu_times()[:2]) for x in ps if x.is_running())
        return out

    def metric(self, name: str, labels: str = 'model="demo"') -> float:
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith(f"{name}{{{labels}}} "):
                return float(line.split()[-1])
        return 0.0

    def close(self) -> None:
        import psycopg

        for proc in self.procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.db}" WITH (FORCE)')


# --- streams ----------------------------------------------------------------------------


@dataclass
class Stream:
    ttft: float = 0.0  # seconds from sending to the first text
    gaps: list[float] = field(default_factory=list)  # between text chunks after the first
    tokens: int = 0  # completion tokens (the usage chunk)


async def stream_once(client: httpx.AsyncClient, body: dict[str, Any]) -> Stream:
    out = Stream()
    start = last = time.perf_counter()
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=payload) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            now = time.perf_counter()
            if chunk["choices"] and chunk["choices"][0]["text"]:
                if not out.ttft:
                    out.ttft = now - start
                else:
                    out.gaps.append(now - last)
                last = now
            if chunk.get("usage"):
                out.tokens = chunk["usage"]["completion_tokens"]
    return out


def online_body(rng: random.Random, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "demo",
        "prompt": _prompt(rng),
        "max_tokens": max_tokens,
        "temperature": 0,
        "logit_bias": EOS_BAN,
    }


async def concurrent(
    url: str, key: str, bodies: list[dict[str, Any]]
) -> tuple[list[Stream], float]:
    """All at once; (streams, wall seconds from the first send to the last end)."""
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as c:
        start = time.perf_counter()
        streams = await asyncio.gather(*(stream_once(c, b) for b in bodies))
        return list(streams), time.perf_counter() - start


async def closed_loop(
    url: str, key: str, clients: int, max_tokens: int, stop: threading.Event | None, count: int
) -> list[Stream]:
    """`clients` loops of one stream after another, until `stop` (or `count` each)."""
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=clients)
    done: list[Stream] = []

    async def loop(i: int) -> None:
        rng = random.Random(1000 + i)
        n = 0
        while (stop is None and n < count) or (stop is not None and not stop.is_set()):
            done.append(await stream_once(c, online_body(rng, max_tokens)))
            n += 1

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as c:
        await asyncio.gather(*(loop(i) for i in range(clients)))
    return done


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


# --- the engine alone -------------------------------------------------------------------


def engine_alone(home: Path, max_rows: int, bodies: list[dict[str, Any]]) -> tuple[int, float]:
    """The same requests through Engine.run in this process with the worker's CPU threads
    (runner.set_cpu_threads); (completion tokens, seconds)."""
    import torch

    from batchwright.engine.engine import Engine
    from batchwright.engine.requests.types import GenRequest
    from batchwright.registry import ModelSpec
    from batchwright.serving.lines import prepared

    engine = Engine.load(ModelSpec(name="demo", path=home / "models" / "demo", max_rows=max_rows))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))
    requests = [GenRequest(i, b) for i, b in enumerate(bodies)]
    list(engine.run(prepared(engine, requests[:2])))  # warm-up (first-call costs)
    start = time.perf_counter()
    tokens = sum(r.completion_tokens for r in engine.run(prepared(engine, requests)))
    return tokens, time.perf_counter() - start


# --- the batch --------------------------------------------------------------------------


def batch_file(n: int, max_tokens: int) -> bytes:
    rng = random.Random(7)
    out = io.BytesIO()
    for i in range(n):
        body: dict[str, Any] = {
            "model": "demo",
            "prompt": _prompt(rng),
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        if i % 4 == 3:  # seeded sampling: preempted lines must give the same text too
            body |= {"temperature": 1.0, "seed": i}
        line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
        out.write(json.dumps(line).encode() + b"\n")
    return out.getvalue()


@dataclass
class BatchRun:
    lines: int = 0
    seconds: float = 0.0  # from its first finished line to its last
    tokens: int = 0  # output tokens
    output: dict[str, Any] = field(default_factory=dict)
    duplicates: int = 0
    errors: int = 0
    rows: list[float] = field(default_factory=list)  # the worker's lines in flight, sampled


def run_batch(stack: Stack, data: bytes, started: threading.Event | None = None) -> BatchRun:
    from openai import OpenAI

    client = OpenAI(base_url=stack.url + "/v1", api_key=stack.key, max_retries=2, timeout=600)
    file = client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
    )
    first = 0.0
    at_first = 0
    rows: list[float] = []
    while True:
        b = client.batches.retrieve(batch.id)
        if first:
            rows.append(stack.metric("batchwright_worker_rows_in_flight"))
        counts = b.request_counts
        finished = (counts.completed + counts.failed) if counts else 0
        if finished and not first:
            first, at_first = time.perf_counter(), finished
            if started is not None:
                started.set()
        if b.status in ("completed", "failed", "expired", "cancelled"):
            break
        time.sleep(0.2)
    end = time.perf_counter()
    run = BatchRun(lines=(counts.total if counts else 0) - at_first, seconds=end - first)
    run.rows = rows
    run.tokens = b.usage.output_tokens if b.usage else 0
    if b.output_file_id:
        for line in client.files.content(b.output_file_id).text.splitlines():
            row = json.loads(line)
            cid = row["custom_id"]
            if cid in run.output:
                run.duplicates += 1
            body = row["response"]["body"]
            run.output[cid] = (
                [(c["text"], c["finish_reason"]) for c in body["choices"]],
                body["usage"]["completion_tokens"],
            )
    if b.error_file_id:
        run.errors = len(client.files.content(b.error_file_id).text.splitlines())
    return run


# --- AIPerf -----------------------------------------------------------------------------


def aiperf(binary: str, stack: Stack, concurrency: int, out: Path, *extra: str) -> str:
    args = [
        binary, "profile", "--model", "demo", "--url", stack.url,
        "--endpoint-type", "completions", "--streaming",
        "--tokenizer", str(stack.home / "models" / "demo"), "--use-server-token-count",
        "--use-legacy-max-tokens", "--synthetic-input-tokens-mean", "16",
        "--output-tokens-mean", "64", "--extra-inputs", json.dumps({"logit_bias": EOS_BAN}),
        "--api-key", stack.key, "--ui-type", "none",
        "--concurrency", str(concurrency), *extra, "--artifact-dir", str(out),
    ]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return f"aiperf failed ({done.returncode}): {(done.stdout + done.stderr)[-1500:]}"
    return summarize_aiperf(out)


def summarize_aiperf(out: Path) -> str:
    found = sorted(out.rglob("profile_export_aiperf.json"))
    if not found:
        return f"aiperf: no export under {out}"
    data = json.loads(found[-1].read_text())
    ttft, itl = data.get("time_to_first_token") or {}, data.get("inter_token_latency") or {}
    tput = (data.get("output_token_throughput") or {}).get("avg", 0.0)
    return (
        f"TTFT p50 {ttft.get('p50', 0):.1f} ms, p99 {ttft.get('p99', 0):.1f} ms; "
        f"inter-token p50 {itl.get('p50', 0):.1f} ms; {tput:.0f} output tok/s; "
        f"{(data.get('request_count') or {}).get('avg', 0):.0f} requests"
    )


# --- the run ----------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-lines", type=int, default=20000)
    # Lines long enough that the engine, not the claims and writes, bounds the batch.
    ap.add_argument("--batch-max-tokens", type=int, default=64)
    ap.add_argument("--online-max-tokens", type=int, default=64)
    ap.add_argument("--max-rows", type=int, default=64)
    ap.add_argument("--aiperf", default="", help="AIPerf's `aiperf` executable (optional)")
    args = ap.parse_args()

    from batchwright.engine.loading.demo import build_demo_model

    home = Path(tempfile.mkdtemp(prefix="bw-online-home-"))
    build_demo_model(home / "models" / "demo")
    stack = Stack(home, args.max_rows)
    try:
        measure(stack, home, args)
    finally:
        stack.close()
        shutil.rmtree(home, ignore_errors=True)


def measure(stack: Stack, home: Path, args: argparse.Namespace) -> None:
    url, key, mt = stack.url, stack.key, args.online_max_tokens
    rng = random.Random(3)
    asyncio.run(concurrent(url, key, [online_body(rng, 4)]))  # warm-up
    print("(i) idle", flush=True)
    ones = [asyncio.run(concurrent(url, key, [online_body(rng, mt)]))[0][0] for _ in range(5)]
    ttft1 = statistics.median(s.ttft for s in ones)
    itl1 = statistics.mean(g for s in ones for g in s.gaps)
    print(f"  one stream: TTFT {ms(ttft1)}, inter-token {ms(itl1)} (median of 5)")
    bodies = [online_body(rng, mt) for _ in range(32)]
    cpu0, mine0 = stack.cpu(), time.process_time()
    streams, wall = asyncio.run(concurrent(url, key, bodies))
    cpu1, mine1 = stack.cpu(), time.process_time()
    served = sum(s.tokens for s in streams) / wall
    tokens, seconds = engine_alone(home, args.max_rows, bodies)
    alone = tokens / seconds
    print(
        f"  32 streams: endpoint {served:.0f} tok/s, engine alone {alone:.0f} tok/s: "
        f"{served / alone:.2f}x (target >= 0.8x)"
    )
    spent = {k: cpu1[k] - cpu0[k] for k in cpu0}
    print(
        f"    CPU seconds in those {wall:.2f} s: worker {spent['worker']:.2f}, API "
        f"{spent['api']:.2f}, clients {mine1 - mine0:.2f}; the engine alone {seconds:.2f} s "
        f"on {os.cpu_count()} cores"
    )
    idle = asyncio.run(closed_loop(url, key, 16, mt, None, 4))
    idle_ttft = [s.ttft for s in idle]
    p50, p99 = pct(idle_ttft, 0.5), pct(idle_ttft, 0.99)
    print(f"  16 streams (closed loop, {len(idle)} requests): TTFT p50 {ms(p50)}, p99 {ms(p99)}")

    print(f"(ii) under a batch of {args.batch_lines} lines", flush=True)
    data = batch_file(args.batch_lines, args.batch_max_tokens)
    steps0 = stack.metric("batchwright_worker_engine_step_seconds_count")
    secs0 = stack.metric("batchwright_worker_engine_step_seconds_sum")
    base = run_batch(stack, data)
    steps = stack.metric("batchwright_worker_engine_step_seconds_count") - steps0
    step = (stack.metric("batchwright_worker_engine_step_seconds_sum") - secs0) / max(1, steps)
    print(
        f"  batch alone: {base.lines / base.seconds:.1f} lines/s, "
        f"{base.tokens / base.seconds:.0f} tok/s; mean engine step {ms(step)} "
        f"({args.max_rows} rows); lines in the worker {statistics.mean(base.rows or [0]):.0f} "
        f"on average (rows and read-ahead)"
    )
    preempted0 = stack.metric("batchwright_worker_preemptions_total")
    started, stop = threading.Event(), threading.Event()
    loaded: list[Stream] = []

    def traffic() -> None:
        started.wait()
        loaded.extend(asyncio.run(closed_loop(url, key, 16, mt, stop, 0)))

    thread = threading.Thread(target=traffic)
    thread.start()
    run = run_batch(stack, data, started)
    stop.set()
    thread.join()
    ttft = [s.ttft for s in loaded]
    l50, l99 = pct(ttft, 0.5), pct(ttft, 0.99)
    online_tokens = sum(s.tokens for s in loaded)
    share = online_tokens / max(1, online_tokens + run.tokens)
    ratio = (run.lines / run.seconds) / (base.lines / base.seconds)
    same = sum(1 for k, v in base.output.items() if run.output.get(k) == v)
    differ = [k for k, v in base.output.items() if k in run.output and run.output[k] != v]
    preempted = stack.metric("batchwright_worker_preemptions_total") - preempted0
    lost = args.batch_lines - len(run.output) - run.errors
    print(
        f"  16 streams beside it ({len(loaded)} requests): TTFT p50 {ms(l50)} "
        f"({l50 / p50:.2f}x idle, target <= 2x), p99 {ms(l99)} ({l99 / p99:.2f}x, target "
        f"<= 4x); one engine step of the batch: {ms(step)}"
    )
    print(
        f"  batch with online traffic: {run.lines / run.seconds:.1f} lines/s, {ratio:.2f}x "
        f"alone; online tokens' share {share:.1%}: allowed down to "
        f"{1 - share - 0.10:.2f}x"
    )
    print(
        f"  output: {same}/{len(base.output)} lines identical to the run alone; "
        f"lost {lost}, written twice {run.duplicates}, errors {run.errors}; "
        f"batch lines preempted {preempted:.0f}"
    )
    if differ:
        print(f"  lines that differ: {', '.join(map(str, differ[:10]))}")
    if args.aiperf:
        print("AIPerf (same endpoint)", flush=True)
        out = Path(tempfile.mkdtemp(prefix="bw-aiperf-"))
        ai = args.aiperf
        print("  1 stream:", aiperf(ai, stack, 1, out / "c1", "--request-count", "8"))
        print("  32 streams:", aiperf(ai, stack, 32, out / "c32", "--request-count", "32"))
        print("  16 streams idle:", aiperf(ai, stack, 16, out / "c16", "--request-count", "64"))
        going = threading.Event()
        runner = threading.Thread(target=run_batch, args=(stack, data, going))
        runner.start()
        going.wait()  # its first lines are done: its rows are full
        seconds = str(max(10, int(0.8 * base.seconds)))
        loaded_run = aiperf(ai, stack, 16, out / "c16-batch", "--benchmark-duration", seconds)
        print("  16 streams beside the batch:", loaded_run)
        runner.join()
        print(f"  artifacts: {out}")


if __name__ == "__main__":
    main()
