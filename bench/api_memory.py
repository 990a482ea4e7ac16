"""Peak memory of each stage of a maximal batch: a ~200 MB, 50,000-line upload through the
API, its validation (worker code), rendering of its output file, and its download.

Needs Postgres on 127.0.0.1 (trust auth) and Redis. Output rows are synthetic (a fixed
Completion per line written with SQL) because generating 50,000 completions on a CPU is
not what this measures. Usage: python bench/api_memory.py [--lines 50000] [--bound-mb 400]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import psutil
import psycopg

ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


class PeakRSS:
    """Samples a process's RSS every few milliseconds and keeps the maximum."""

    def __init__(self, pid: int) -> None:
        self.proc, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.005)

    def __enter__(self) -> PeakRSS:
        self.peak = self.proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._stop.clear()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def lines(n: int, line_bytes: int) -> Iterator[bytes]:
    for i in range(n):
        head = (
            b'{"custom_id":"r%d","method":"POST","url":"/v1/completions",'
            b'"body":{"model":"demo","max_tokens":4,"prompt":"' % i
        )
        tail = b'"}}\n'
        yield head + b"w" * max(1, line_bytes - len(head) - len(tail)) + tail


def multipart(n: int, line_bytes: int) -> Iterator[bytes]:
    yield b'--bnd\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    yield b'--bnd\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
    buf = bytearray()
    for line in lines(n, line_bytes):
        buf += line
        if len(buf) >= 1 << 20:
            yield bytes(buf)
            buf.clear()
    yield bytes(buf) + b"\r\n--bnd--\r\n"


CHILD = """
import resource, sys
from batchwright.worker.generation import runner
getattr(runner, sys.argv[1])(sys.argv[2])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""

SYNTHETIC = """
UPDATE batch_requests SET state='succeeded', status_code=200, prompt_tokens=5,
  completion_tokens=4, lease_token=NULL WHERE batch_id=%(b)s;
INSERT INTO completions (id, request_row_id, batch_id, model, body, prompt_tokens,
  completion_tokens, total_tokens, created_at)
SELECT 'cmpl-' || id, id, batch_id, 'demo',
  '{"id":"cmpl-' || id || '","object":"text_completion","created":0,"model":"demo",'
  || '"system_fingerprint":"fp_bench","choices":[{"index":0,"text":"' || repeat('x', 3500)
  || '","logprobs":null,"finish_reason":"length"}],'
  || '"usage":{"prompt_tokens":5,"completion_tokens":4,"total_tokens":9}}',
  5, 4, 9, 0 FROM batch_requests WHERE batch_id=%(b)s;
UPDATE batches SET status='finalizing' WHERE id=%(b)s;
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=50_000)
    ap.add_argument("--line-bytes", type=int, default=4000)
    ap.add_argument("--bound-mb", type=float, default=400.0)
    args = ap.parse_args()

    db = f"bw_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db}"')
    url = ADMIN.rsplit("/", 1)[0] + "/" + db
    env = {
        **os.environ,
        "BATCHWRIGHT_DATABASE_URL": url,
        "BATCHWRIGHT_BROKER_URL": "redis://127.0.0.1:6379/7",
        "BATCHWRIGHT_QUEUE": f"bench-{db}",
    }  # nobody consumes it: stages run by hand
    run = [sys.executable, "-m", "batchwright.cli"]
    subprocess.run([*run, "db", "upgrade"], env=env, check=True, capture_output=True)
    key = (
        subprocess.run(
            [*run, "keys", "create"], env=env, check=True, capture_output=True, text=True
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    api = subprocess.Popen(
        [*run, "serve", "--port", "8765"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    rows: list[tuple[str, float, float]] = []
    try:
        http = httpx.Client(
            base_url="http://127.0.0.1:8765",
            timeout=600,
            headers={"Authorization": f"Bearer {key}"},
        )
        for _ in range(100):
            try:
                http.get("/healthz")
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        size = sum(len(x) for x in lines(args.lines, args.line_bytes))
        t0 = time.perf_counter()
        with PeakRSS(api.pid) as peak:
            resp = http.post(
                "/v1/files",
                content=multipart(args.lines, args.line_bytes),
                headers={"content-type": "multipart/form-data; boundary=bnd"},
            )
        resp.raise_for_status()
        file_id = resp.json()["id"]
        rows.append(("upload (API)", peak.peak / 2**20, time.perf_counter() - t0))

        batch = http.post(
            "/v1/batches",
            json={
                "input_file_id": file_id,
                "endpoint": "/v1/completions",
                "completion_window": "24h",
            },
        )
        batch_id = batch.json()["id"]
        for stage, fn in (("validation (worker)", "validate_batch"),):
            t0 = time.perf_counter()
            out = subprocess.run(
                [sys.executable, "-c", CHILD, fn, batch_id],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            )
            rows.append((stage, int(out.stdout.split()[-1]) / 2**20, time.perf_counter() - t0))
        assert http.get(f"/v1/batches/{batch_id}").json()["status"] == "in_progress"

        with psycopg.connect(url, autocommit=True) as conn:
            for statement in filter(str.strip, SYNTHETIC.split(";")):
                conn.execute(statement, {"b": batch_id})  # type: ignore[call-overload]
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", CHILD, "finalize_batch", batch_id],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        rows.append(
            (
                "output rendering (worker)",
                int(out.stdout.split()[-1]) / 2**20,
                time.perf_counter() - t0,
            )
        )
        done = http.get(f"/v1/batches/{batch_id}").json()
        assert done["status"] == "completed", done

        t0 = time.perf_counter()
        got = 0
        with (
            PeakRSS(api.pid) as peak,
            http.stream("GET", f"/v1/files/{done['output_file_id']}/content") as stream,
        ):
            for chunk in stream.iter_bytes():
                got += len(chunk)
        rows.append(("download (API)", peak.peak / 2**20, time.perf_counter() - t0))
    finally:
        api.terminate()
        api.wait(10)
        with psycopg.connect(ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')

    print(f"input: {args.lines} lines, {size / 2**20:.1f} MiB; output: {got / 2**20:.1f} MiB")
    print(f"{'stage':28} {'peak RSS MiB':>12} {'seconds':>8}  bound {args.bound_mb:.0f} MiB")
    for stage, mib, secs in rows:
        verdict = "ok" if mib <= args.bound_mb else "OVER"
        print(f"{stage:28} {mib:12.1f} {secs:8.1f}  {verdict}")


if __name__ == "__main__":
    main()
