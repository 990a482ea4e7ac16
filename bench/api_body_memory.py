"""Peak RSS of the API under hostile request bodies (issue 22, item 7): 300 MiB JSON bodies
with and without a valid key, declared (Content-Length) and streamed (chunked), a 300 MiB
dashboard form, and a JSON body just under the cap that is as costly to parse as JSON gets
(an array of floats). Each leg must leave the API under the bound (300 MiB).

Needs Postgres on 127.0.0.1 (trust auth). Usage:
    python bench/api_body_memory.py [--mib 300] [--bound-mb 300]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import temp_database
from api_memory import PeakRSS

from batchwright.config import get_settings

PORT = 8766
KIB64 = 64 * 1024
FLOATS = b"[" + b"0.5," * (KIB64 // 4 - 1) + b"0.5],"  # 64 KiB of floats
# The costliest JSON to parse: an empty list (56 bytes and a pointer) per 3 bytes.
NESTS = b"[" + b"[]," * (KIB64 // 3 - 1) + b"[]],"
OPEN = b'{"input_file_id": "file-x", "endpoint": "/v1/completions", "completion_window": "24h", '
OPEN += b'"metadata": {"k": ['
ONLINE = b'{"model": "demo", "prompt": ['
CHAT = b'{"model": "demo", "messages": ['
CLOSE = b"[]]}}"


def _send(head: bytes, pieces: Iterator[bytes]) -> int:
    """Stream a request as far as the server takes it; its status, or 0 if it hung up."""
    with socket.create_connection(("127.0.0.1", PORT), timeout=300) as sock:
        try:
            sock.sendall(head)
            for piece in pieces:
                sock.sendall(piece)
        except OSError:
            pass  # refused mid-body: the answer may still be there to read
        try:
            answer = sock.recv(65536)
        except OSError:
            return 0
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1") else 0


def _body(total: int, piece: bytes, opening: bytes = OPEN) -> list[bytes]:
    """A valid JSON body of about `total` bytes, `piece` repeated inside: the metadata (or
    prompt) is the wrong type, but the body is parsed whole before that is found."""
    close = CLOSE if opening == OPEN else b"[]]}"  # the online bodies nest one level less
    return [opening, *[piece] * max((total - len(opening) - len(close)) // len(piece), 0), close]


def _request(
    path: str, key: str | None, parts: list[bytes], chunked: bool
) -> tuple[bytes, Iterator[bytes]]:
    ctype = (
        "application/x-www-form-urlencoded" if path.startswith("/dashboard") else "application/json"
    )
    lines = [f"POST {path} HTTP/1.1", "Host: bench", f"Content-Type: {ctype}"]
    if key:
        lines.append(f"Authorization: Bearer {key}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
        framed = (b"%x\r\n%s\r\n" % (len(x), x) for x in [*parts, b""])
        return ("\r\n".join(lines) + "\r\n\r\n").encode(), framed
    lines.append(f"Content-Length: {sum(map(len, parts))}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode(), iter(parts)


@contextmanager
def _api(env: dict[str, str]) -> Iterator[int]:
    """A fresh API process (its pid), so that each leg's peak is its own."""
    api = subprocess.Popen(
        [sys.executable, "-m", "batchwright.cli", "serve", "--port", str(PORT)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(300):
            try:
                httpx.get(f"http://127.0.0.1:{PORT}/healthz")
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield api.pid
    finally:
        api.terminate()
        api.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=300)
    ap.add_argument("--bound-mb", type=float, default=300.0)
    args = ap.parse_args()
    huge = args.mib * 2**20
    limit = get_settings().max_json_body_bytes
    rows: list[tuple[str, int, float, float]] = []
    with temp_database() as url:
        # A broker nobody consumes: the online endpoint reads its body, then finds no worker.
        env = {**os.environ, "BATCHWRIGHT_DATABASE_URL": url,
               "BATCHWRIGHT_BROKER_URL": "redis://127.0.0.1:6379/7",
               "BATCHWRIGHT_QUEUE": f"bench-body-{os.getpid()}"}  # fmt: skip
        made = subprocess.run(
            [sys.executable, "-m", "batchwright.cli", "keys", "create"],
            env=env, check=True, capture_output=True, text=True,
        )  # fmt: skip
        key = made.stdout.strip().splitlines()[-1]
        big, cap = f"{args.mib} MiB", "at the cap"
        form = [b"key=", *[b"k" * KIB64] * (huge // KIB64)]
        legs = [
            ("/v1/batches", f"no key, {big}", None, _body(huge, FLOATS), False),
            ("/v1/batches", f"no key, {big} chunked", None, _body(huge, FLOATS), True),
            ("/v1/batches", big, key, _body(huge, FLOATS), False),
            ("/v1/batches", f"{big} chunked", key, _body(huge, FLOATS), True),
            ("/v1/batches", f"floats {cap}", key, _body(limit, FLOATS), False),
            ("/v1/batches", f"empty lists {cap}", key, _body(limit, NESTS), False),
            ("/v1/completions", f"floats {cap}", key, _body(limit, FLOATS, ONLINE), False),
            ("/v1/completions", f"empty lists {cap}", key, _body(limit, NESTS, ONLINE), False),
            ("/v1/chat/completions", f"floats {cap}", key, _body(limit, FLOATS, CHAT), False),
            ("/v1/chat/completions", f"empty lists {cap}", key, _body(limit, NESTS, CHAT), False),
            ("/dashboard/login", f"form, {big}", None, form, False),
        ]
        for path, what, who, parts, chunked in legs:
            with _api(env) as pid:
                rest = psutil.Process(pid).memory_info().rss / 2**20
                head, body = _request(path, who, parts, chunked)
                with PeakRSS(pid) as peak:
                    status = _send(head, body)
                rows.append((f"{path}: {what}", status, rest, peak.peak / 2**20))

    print(f"JSON body cap {limit} bytes; bound {args.bound_mb:.0f} MiB")
    print(f"{'request':44} {'status':>6} {'at rest':>8} {'peak RSS MiB':>12}")
    for name, status, rest, peak_mib in rows:
        verdict = "ok" if peak_mib <= args.bound_mb else "OVER"
        print(f"{name:44} {status:6d} {rest:8.1f} {peak_mib:12.1f}  {verdict}")


if __name__ == "__main__":
    main()
