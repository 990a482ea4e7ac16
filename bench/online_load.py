"""One API process at concurrency 256 (issue 33, item 1), measured with AIPerf from PyPI.

The real service on this machine (bench/online_bench.py's Stack: `batchwright serve`, one
`batchwright worker --models demo`, a throwaway Postgres database, a queue of its own on
Redis, the demo model). AIPerf streams completions at concurrency 256 against the one
API process; its export counts the requests by outcome. Three runs:

  (a) the default per-project in-flight cap (64): every answer a 200 or a 429 with
      Retry-After, no 5xx, no connection reset;
  (b) the cap raised past the concurrency (its own stack): TTFT and ITL percentiles idle;
  (c) the same beside a running batch.

AIPerf pins versions of orjson, psutil and rich below the project's: install it apart
(`python3.11 -m venv /tmp/aiperf && /tmp/aiperf/bin/pip install aiperf`, or the `bench`
extra in a venv of its own) and pass its executable:

    PYTHONPATH=src python bench/online_load.py --aiperf /tmp/aiperf/bin/aiperf \
        [--requests 1024] [--max-rows 256] [--batch-lines 4000]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from online_bench import EOS_BAN, Stack, batch_file, run_batch


def profile(
    binary: str, stack: Stack, concurrency: int, requests: int, out: Path
) -> dict[str, Any]:
    args = [
        binary, "profile", "--model", "demo", "--url", stack.url,
        "--endpoint-type", "completions", "--streaming",
        "--tokenizer", str(stack.home / "models" / "demo"), "--use-server-token-count",
        "--use-legacy-max-tokens", "--synthetic-input-tokens-mean", "16",
        "--output-tokens-mean", "32", "--extra-inputs", json.dumps({"logit_bias": EOS_BAN}),
        "--api-key", stack.key, "--ui-type", "none",
        "--concurrency", str(concurrency), "--request-count", str(requests),
        "--artifact-dir", str(out),
    ]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    (out / "aiperf.log").parent.mkdir(parents=True, exist_ok=True)
    (out / "aiperf.log").write_text(done.stdout + done.stderr)
    found = sorted(out.rglob("profile_export_aiperf.json"))
    if not found:
        raise RuntimeError(f"aiperf wrote no export ({done.returncode}): {done.stderr[-2000:]}")
    return dict(json.loads(found[-1].read_text()))


def summary(data: dict[str, Any]) -> str:
    def stat(name: str) -> dict[str, float]:
        return data.get(name) or {}

    ttft, itl = stat("time_to_first_token"), stat("inter_token_latency")
    ok = stat("request_count").get("avg", 0)
    errors = data.get("error_summary") or []
    by_code: dict[str, int] = {}
    for e in errors:
        details = e.get("error_details") or {}
        code = str(details.get("code") or details.get("type") or "?")
        by_code[code] = by_code.get(code, 0) + int(e.get("count") or 0)
    return (
        f"{ok:.0f} answered 200; errors by code {by_code or 'none'}; "
        f"TTFT p50 {ttft.get('p50', 0):.0f} ms, p90 {ttft.get('p90', 0):.0f}, "
        f"p99 {ttft.get('p99', 0):.0f}; ITL p50 {itl.get('p50', 0):.1f} ms, "
        f"p90 {itl.get('p90', 0):.1f}, p99 {itl.get('p99', 0):.1f}"
    )


def api_log_problems(stack: Stack) -> str:
    text = (stack.logs / "api.log").read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if " 500" in ln or "Traceback" in ln]
    return f"{len(lines)} lines with a 500 or a traceback in the API's log"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--aiperf", required=True)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--max-rows", type=int, default=256)
    ap.add_argument("--batch-lines", type=int, default=4000)
    args = ap.parse_args()

    from batchwright.engine.loading.demo import build_demo_model

    home = Path(tempfile.mkdtemp(prefix="bw-load-home-"))
    build_demo_model(home / "models" / "demo")
    out = Path(tempfile.mkdtemp(prefix="bw-load-"))
    c, n = args.concurrency, args.requests
    try:
        stack = Stack(home, args.max_rows)
        try:
            data = profile(args.aiperf, stack, c, n, out / "a-capped")
            print(f"(a) default in-flight cap, concurrency {c}: {summary(data)}")
            print(f"    {api_log_problems(stack)}")
        finally:
            stack.close()
        stack = Stack(home, args.max_rows, ONLINE_MAX_IN_FLIGHT_PER_PROJECT=str(4 * c))
        try:
            data = profile(args.aiperf, stack, c, n, out / "b-idle")
            print(f"(b) idle, concurrency {c}: {summary(data)}")
            going = threading.Event()
            batch = threading.Thread(
                target=run_batch, args=(stack, batch_file(args.batch_lines, 64), going)
            )
            batch.start()
            going.wait()  # its first lines are done: its rows are full
            data = profile(args.aiperf, stack, c, n, out / "c-batch")
            print(
                f"(c) beside a batch of {args.batch_lines} lines, concurrency {c}: {summary(data)}"
            )
            batch.join()
            print(f"    {api_log_problems(stack)}")
        finally:
            stack.close()
        print(f"artifacts: {out}")
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
