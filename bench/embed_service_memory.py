"""A 50,000-line /v1/embeddings batch through the whole service: API, a worker (its
generation process, lease process and control worker), Postgres and Redis. Samples the
resident memory of each process as the lines complete, streams the output file down, and
checks that the batch's usage is the sum of its lines'.

Needs Postgres on 127.0.0.1 (trust auth) and Redis. The model is a random encoder built
here (hidden 256, one layer: the vectors are full-sized, the compute small, so the run
measures the service's handling of 50,000 results rather than the model's arithmetic).

    python bench/embed_service_memory.py [--lines 50000] [--hidden 256]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import psutil
import psycopg

ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


def rss_tree(pid: int) -> dict[str, float]:
    """MiB by process: the worker's children are named by their command line."""
    out: dict[str, float] = {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())
            name = (
                "lease process"
                if "lease_child" in cmd
                else "control worker"
                if "--control-only" in cmd
                else "worker"
                if p.pid == pid
                else f"child {p.pid}"
            )
            out[name] = out.get(name, 0.0) + p.memory_info().rss / 2**20
        except psutil.Error:
            continue
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=50_000)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from batchwright.engine.embed.tiny import build_encoder

    tmp = Path(tempfile.mkdtemp(prefix="bw-embed-mem-"))
    model = build_encoder(tmp / "enc", hidden_size=args.hidden, layers=1, heads=4)
    db = f"bw_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db}"')
    env = {
        **os.environ,
        "BATCHWRIGHT_DATABASE_URL": ADMIN.rsplit("/", 1)[0] + "/" + db,
        "BATCHWRIGHT_BROKER_URL": "redis://127.0.0.1:6379/7",
        "BATCHWRIGHT_QUEUE": f"bench-{db}",
        "BATCHWRIGHT_HOME": str(tmp / "home"),
        "BATCHWRIGHT_MODELS": json.dumps({"models": {"enc": {"path": str(model)}}}),
    }
    run = [sys.executable, "-m", "batchwright.cli"]
    subprocess.run([*run, "db", "upgrade"], env=env, check=True, capture_output=True)
    key = subprocess.run(
        [*run, "keys", "create"], env=env, check=True, capture_output=True, text=True
    ).stdout.split()[-1]
    api = subprocess.Popen(
        [*run, "serve", "--port", "8766"], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    log = (tmp / "worker.log").open("wb")
    worker = subprocess.Popen(
        [*run, "worker", "--models", "enc", "--loglevel", "INFO"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while b"ready." not in (tmp / "worker.log").read_bytes():
            assert worker.poll() is None and time.monotonic() < deadline, "worker did not start"
            time.sleep(0.5)
        http = httpx.Client(
            base_url="http://127.0.0.1:8766", timeout=600,
            headers={"Authorization": f"Bearer {key}"},
        )  # fmt: skip
        words = ["sea", "river", "town", "coast", "people", "mountain", "story", "model"]
        data = "".join(
            json.dumps(
                {
                    "custom_id": f"r{i}",
                    "method": "POST",
                    "url": "/v1/embeddings",
                    "body": {
                        "model": "enc",
                        "input": " ".join(words[(i + j) % 8] for j in range(4 + i % 13)),
                    },
                }
            )
            + "\n"
            for i in range(args.lines)
        ).encode()
        up = http.post("/v1/files", files={"file": ("e.jsonl", data)}, data={"purpose": "batch"})
        up.raise_for_status()
        batch = http.post(
            "/v1/batches",
            json={
                "input_file_id": up.json()["id"],
                "endpoint": "/v1/embeddings",
                "completion_window": "24h",
            },
        ).json()
        t0 = time.monotonic()
        print("seconds  lines done  API MiB  worker MiB (generation / lease process / control)")
        series: list[tuple[float, int, float, dict[str, float]]] = []
        next_print = 0.0
        while True:
            b = http.get(f"/v1/batches/{batch['id']}").json()
            done = b["request_counts"]["completed"] + b["request_counts"]["failed"]
            api_mb = psutil.Process(api.pid).memory_info().rss / 2**20
            tree = rss_tree(worker.pid)
            series.append((time.monotonic() - t0, done, api_mb, tree))
            if time.monotonic() - t0 >= next_print or b["status"] in ("completed", "failed"):
                parts = [
                    f"{tree.get(k, 0):.0f}" for k in ("worker", "lease process", "control worker")
                ]
                print(
                    f"{time.monotonic() - t0:7.0f}  {done:10d}  {api_mb:7.0f}  {' / '.join(parts)}"
                )
                next_print += 30
            if b["status"] in ("completed", "failed", "expired", "cancelled"):
                break
            assert time.monotonic() - t0 < args.timeout, "batch did not finish"
            time.sleep(1)
        assert b["status"] == "completed", b
        # The output streamed down a chunk at a time, the lines' usage summed as it comes.
        lines = used = 0
        peak_api = 0.0
        with http.stream("GET", f"/v1/files/{b['output_file_id']}/content") as resp:
            buffer = b""
            for chunk in resp.iter_bytes():
                buffer += chunk
                *complete, buffer = buffer.split(b"\n")
                for raw in complete:
                    if raw:
                        lines += 1
                        used += json.loads(raw)["response"]["body"]["usage"]["prompt_tokens"]
                peak_api = max(peak_api, psutil.Process(api.pid).memory_info().rss / 2**20)
        print(
            f"output: {lines} lines; lines' usage {used}; batch usage {b['usage']['input_tokens']}"
        )
        assert lines == args.lines and used == b["usage"]["input_tokens"]
        print(f"API during the download: {peak_api:.0f} MiB at most")
        for label, col in (("API", 2),):
            values = [s[col] for s in series]
            print(f"{label}: {min(values):.0f}-{max(values):.0f} MiB over the run")  # type: ignore[type-var]
        for name in ("worker", "lease process", "control worker"):
            values = [s[3].get(name, 0.0) for s in series if s[1] > args.lines // 10]
            if values:
                print(f"{name}: {min(values):.0f}-{max(values):.0f} MiB after the first 10 %")
    finally:
        worker.terminate()
        api.terminate()
        worker.wait(60)
        api.wait(60)
        with psycopg.connect(ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


if __name__ == "__main__":
    main()
