"""An online request's life beyond its chunks, against the real API, Redis and a worker:
a client that leaves cancels it at the worker, a request no worker starts in time is a
503, a project over its rate limit gets a 429, and the README and the CLI work as written."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import openai
import orjson
import pytest
import redis

from tests.conftest import REDIS
from tests.online.conftest import QUEUE_TIMEOUT
from tests.online.e2e import Worker, sse, start_worker
from tests.online.test_admission import usage_rows
from tests.shared.conftest import Service

T = TypeVar("T")

README = Path(__file__).resolve().parents[2] / "README.md"
EOS = 0  # the demo tokenizer's <|endoftext|>: banned below so a stream runs to max_tokens


@pytest.fixture(scope="module")
def worker(service: Service) -> Iterator[Worker]:
    got = start_worker(service, "demo")
    yield got
    got.proc.stop()


def test_a_client_that_leaves_cancels_its_request_at_the_worker(
    service: Service, worker: Worker
) -> None:
    key = service.key("team-leaves")
    cancelled = 'batchwright_worker_online_cancelled_total{model="demo"}'
    before = worker.metric(cancelled) or 0.0
    # Hundreds of engine steps to go when the first chunk arrives (EOS banned).
    body = {
        "model": "demo", "prompt": "Once", "max_tokens": 480, "stream": True,
        "logit_bias": {str(EOS): -100},
    }  # fmt: skip
    prefix = f"{service.env['BATCHWRIGHT_QUEUE']}:online"
    client = redis.Redis.from_url(REDIS)
    firsts: list[str] = []
    leave = threading.Event()

    def stream() -> None:
        with sse(service, key, body) as response:
            firsts.append(next(response.iter_lines()))
            leave.wait(60)

    reader = threading.Thread(target=stream)
    # Frozen, and run a slice at a time until the first chunk is out: the request cannot
    # be finished before the cancel reaches the worker, however fast its engine is.
    worker.proc.signal_group(signal.SIGSTOP)
    try:
        reader.start()
        step_until(worker, lambda: bool(firsts))
        leave.set()
        reader.join(60)
        found = re.search(r'"id":"(cmpl-[^"]+)"', firsts[0])
        assert found, firsts  # a stream's first chunk, not an error
        request_id = found.group(1)
        service.wait(lambda: client.exists(f"{prefix}:cancel:{request_id}"), 30, "the cancel")
    finally:
        worker.proc.signal_group(signal.SIGCONT)
    service.wait(lambda: (worker.metric(cancelled) or 0.0) == before + 1, 60, "the drop")
    in_flight = 'batchwright_worker_rows_in_flight{model="demo"}'
    service.wait(lambda: worker.metric(in_flight) == 0.0, 60, "no rows in flight")
    service.wait(lambda: len(usage_rows(service, "team-leaves")) == 1, 30, "the usage row")
    [row] = usage_rows(service, "team-leaves")
    model, status, stream, _, _, completion_tokens, ttft, _, finish, gone, _ = row
    assert (model, status, stream, gone, finish) == ("demo", 499, True, True, None)
    assert 1 <= completion_tokens < 480 and ttft is not None  # type: ignore[operator]


def test_a_plain_request_whose_client_leaves_is_cancelled_too(
    service: Service, worker: Worker
) -> None:
    key = service.key("team-leaves-plain")
    cancelled = 'batchwright_worker_online_cancelled_total{model="demo"}'
    before = worker.metric(cancelled) or 0.0
    body = orjson.dumps(
        {"model": "demo", "prompt": "Once", "max_tokens": 480, "logit_bias": {str(EOS): -100}}
    )
    host, port = service.api_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    client = redis.Redis.from_url(REDIS)
    prefix = f"{service.env['BATCHWRIGHT_QUEUE']}:online"
    mine = key_id(service, "team-leaves-plain").encode()

    def held() -> bytes | None:
        for name in client.scan_iter(f"{prefix}:taken:*"):
            for raw in client.lrange(name, 0, -1):
                if mine in raw:
                    return bytes(raw)
        return None

    # Frozen, and run a slice at a time until it holds the request: hundreds of steps to go.
    worker.proc.signal_group(signal.SIGSTOP)
    try:
        raw = step_until(worker, held)
        sock.close()
        request_id = orjson.loads(raw)["id"]
        service.wait(lambda: client.exists(f"{prefix}:cancel:{request_id}"), 30, "the cancel")
    finally:
        worker.proc.signal_group(signal.SIGCONT)
    service.wait(lambda: (worker.metric(cancelled) or 0.0) == before + 1, 60, "the drop")
    service.wait(lambda: len(usage_rows(service, "team-leaves-plain")) == 1, 30, "usage row")
    [row] = usage_rows(service, "team-leaves-plain")
    assert (row[1], row[2], row[9]) == (499, False, True)


def step_until(worker: Worker, condition: Callable[[], T | None]) -> T:
    """Run a frozen worker a few milliseconds at a time until `condition()` is truthy;
    it is frozen again when that is returned."""
    for _ in range(20_000):
        got = condition()
        if got:
            return got
        worker.proc.signal_group(signal.SIGCONT)
        time.sleep(0.002)  # a slice of the worker's time, not a wait for an outcome
        worker.proc.signal_group(signal.SIGSTOP)
    raise TimeoutError("the worker never got there")


def key_id(service: Service, project: str) -> str:
    [(found,)] = service.sql(
        "SELECT k.id FROM api_keys k JOIN projects p ON p.id = k.project_id WHERE p.name = %s",
        project,
    )
    return str(found)


def test_a_request_no_worker_starts_in_time_is_a_503(service: Service, worker: Worker) -> None:
    # A worker of demo-b that stays "live" (a long liveness TTL) while frozen: it takes nothing.
    frozen = start_worker(service, "demo-b", BATCHWRIGHT_ONLINE_WORKER_TTL_SECONDS="600")
    frozen.proc.signal_group(signal.SIGSTOP)
    try:
        client = service.client(service.key("team-waits"))
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model="demo-b", prompt="Hello", stream=True)
        body = caught.value.body
        assert caught.value.status_code == 503 and isinstance(body, dict)
        assert body["code"] == "queue_timeout" and f"{QUEUE_TIMEOUT:g} s" in body["message"]
    finally:
        frozen.proc.signal_group(signal.SIGKILL)
        frozen.proc.stop()
        # Its liveness would outlast the test: it is dead, say so (as its TTL would).
        client = redis.Redis.from_url(REDIS)
        prefix = f"{service.env['BATCHWRIGHT_QUEUE']}:online"
        for name in client.scan_iter(f"{prefix}:worker:*"):
            if client.get(name) == b'["demo-b"]':
                client.delete(name)


def test_a_project_over_its_rate_limit_gets_a_429(service: Service, worker: Worker) -> None:
    assert service.cli("projects", "set", "team-limited", "--rpm", "2").returncode == 0
    client = service.client(service.key("team-limited"))
    params = {"model": "demo", "prompt": "Hi", "max_tokens": 2}
    first = client.completions.with_raw_response.create(**params)
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    list(client.completions.create(**params, stream=True))
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(**params, stream=True)
    headers = caught.value.response.headers
    assert int(headers["retry-after"]) >= 1 and headers["x-ratelimit-remaining-requests"] == "0"
    body = caught.value.body
    assert isinstance(body, dict) and body["code"] == "rate_limit_exceeded"
    assert body["type"] == "requests" and "requests per minute" in body["message"]
    # A token budget smaller than one request's max_tokens: refused, and said why.
    assert service.cli("projects", "set", "team-small", "--tpm", "50").returncode == 0
    small = service.client(service.key("team-small"))
    with pytest.raises(openai.RateLimitError) as too_big:
        small.completions.create(model="demo", prompt="Hi", max_tokens=100)
    assert "Request too large" in too_big.value.body["message"]  # type: ignore[index]


def test_the_readme_example_and_the_cli(service: Service, worker: Worker, tmp_path: Path) -> None:
    key = service.key("team-readme")
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    [example] = [b for b in blocks if "stream=True" in b and "completions.create" in b]
    script = tmp_path / "online.py"
    script.write_text(
        example.replace("http://127.0.0.1:8000/v1", service.api_url + "/v1").replace(
            '"sk-bw-..."', repr(key)
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "completion_tokens=16" in done.stdout
    env = {**service.env, "OPENAI_BASE_URL": service.api_url, "OPENAI_API_KEY": key}
    for extra in ([], ["--stream"]):
        cli = subprocess.run(
            [sys.executable, "-m", "batchwright.cli", "complete", "Once upon", "--model", "demo",
             "--max-tokens", "8", "--temperature", "0", *extra],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert cli.returncode == 0, cli.stderr
        assert cli.stdout.strip() and "8 completion tokens" in cli.stderr
