"""Shared by the online end-to-end tests: a worker of the stack serving online requests,
raw SSE reading, and the choices a stream adds up to."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import redis

from tests.conftest import REDIS, Proc, _free_port
from tests.shared.conftest import Service


@dataclass
class Worker:
    proc: Proc
    metrics_port: int
    models: list[str]

    def metric(self, line_prefix: str) -> float | None:
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(line_prefix + " "):
                return float(line.rsplit(" ", 1)[1])
        return None


def live_online_workers(svc: Service, model: str) -> int:
    client = redis.Redis.from_url(REDIS)
    prefix = f"{svc.env['BATCHWRIGHT_QUEUE']}:online"
    members = client.smembers(f"{prefix}:serving:{model}")
    return sum(1 for w in members if client.exists(f"{prefix}:worker:{w.decode()}"))


def start_worker(svc: Service, model: str = "demo", **env: str) -> Worker:
    port = _free_port()
    proc = svc.spawn(
        f"worker-{model}",
        ["worker", "--models", model, "--loglevel", "INFO"],
        BATCHWRIGHT_WORKER_METRICS_PORT=str(port),
        **env,
    )
    proc.wait_for("ready.")
    worker = Worker(proc, port, [model])
    # Announced at once; it takes requests once its model loaded.
    loaded = f'batchwright_worker_model_loaded{{model="{model}"}}'
    svc.wait(lambda: worker.metric(loaded) == 1.0, 300, f"{model} loaded")
    svc.wait(lambda: live_online_workers(svc, model) >= 1, 120, f"an online worker of {model}")
    return worker


@contextlib.contextmanager
def sse(svc: Service, key: str, body: dict[str, Any]) -> Iterator[httpx.Response]:
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream(
        "POST", svc.api_url + "/v1/completions", json=body, headers=headers, timeout=120
    ) as response:
        yield response


def events(response: httpx.Response) -> list[bytes]:
    """The data of each event, checking the framing: data-only lines, a blank line after."""
    raw = response.read()
    out = []
    for block in raw.split(b"\n\n"):
        if not block:
            continue
        assert block.startswith(b"data: ") and b"\n" not in block, block[:200]
        out.append(block[len(b"data: ") :])
    return out


@dataclass
class Assembled:
    text: str = ""
    finish_reason: str | None = None
    finish_chunks: int = 0
    chunks: int = 0
    logprobs: dict[str, list[Any]] = field(default_factory=dict)


def assemble(chunks: list[dict[str, Any]]) -> dict[int, Assembled]:
    """What the chunks add up to, per choice index."""
    out: dict[int, Assembled] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            got = out.setdefault(choice["index"], Assembled())
            got.chunks += 1
            got.text += choice["text"]
            if choice["finish_reason"] is not None:
                got.finish_reason = choice["finish_reason"]
                got.finish_chunks += 1
            for name, values in (choice.get("logprobs") or {}).items():
                got.logprobs.setdefault(name, []).extend(values)
    return out


def parse(data: list[bytes]) -> list[dict[str, Any]]:
    assert data[-1] == b"[DONE]"
    return [orjson.loads(d) for d in data[:-1]]
