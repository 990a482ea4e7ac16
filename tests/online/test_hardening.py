"""Issue 33 against the real API, Redis and a worker: many concurrent requests get 200s or
429/503s with Retry-After (never a 500), hostile bodies are 400s before any check runs
long, the worker's refusals keep their status when streamed, metrics are not public and
label only registry names, events never stay in Redis for good, an unread stream is
dropped at the worker, rate-limit headers always come, and idle connections live on."""

from __future__ import annotations

import re
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
import redis

from tests.conftest import REDIS, _free_port
from tests.online.e2e import Worker, start_worker
from tests.online.test_admission import usage_rows
from tests.online.test_lifecycle import step_until
from tests.shared.conftest import METRICS, Service

EOS = 0


@pytest.fixture(scope="module")
def worker(service: Service) -> Iterator[Worker]:
    # A small unread-bytes window: a stream nobody reads is dropped soon.
    got = start_worker(service, "demo", BATCHWRIGHT_ONLINE_MAX_UNREAD_BYTES="200000")
    yield got
    got.proc.stop()


def _post(svc: Service, key: str, body: Any, path: str = "/v1/completions") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(svc.api_url + path, json=body, headers=headers, timeout=120)


def test_many_concurrent_requests_get_answers_never_a_500(service: Service, worker: Worker) -> None:
    # Before: each waiting request held a connection of the API's Redis pool; past 100 the
    # pool raised and the requests got 500s (and no usage rows).
    key = service.key("team-flood")
    body = {"model": "demo", "prompt": "Hi", "max_tokens": 2}
    statuses: list[int] = []
    retry_after: list[str | None] = []
    failures: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(150)

    def one() -> None:
        try:
            start.wait(60)
            r = _post(service, key, body)
            with lock:
                statuses.append(r.status_code)
                retry_after.append(r.headers.get("retry-after"))
        except BaseException as exc:  # a reset connection, a timeout
            with lock:
                failures.append(exc)

    threads = [threading.Thread(target=one) for _ in range(150)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not failures, failures[:3]
    counts = Counter(statuses)
    assert set(counts) <= {200, 429, 503}, counts
    assert counts[200] >= 1, counts
    assert all(ra for s, ra in zip(statuses, retry_after, strict=True) if s != 200)
    service.wait(lambda: len(usage_rows(service, "team-flood")) == 150, 60, "150 usage rows")


def test_a_project_past_its_in_flight_cap_gets_a_429_others_do_not(
    service: Service, worker: Worker
) -> None:
    # An API process of its own with a cap of 2 requests in flight per project.
    port = _free_port()
    api = service.spawn(
        "api-capped",
        ["serve", "--port", str(port)],
        BATCHWRIGHT_ONLINE_MAX_IN_FLIGHT_PER_PROJECT="2",
        BATCHWRIGHT_METRICS_PORT="0",  # the stack's API has that port
        # The worker runs a few milliseconds at a time below: it may take a while to start
        # the streams (the stack's 3 s would answer them 503 first).
        BATCHWRIGHT_ONLINE_QUEUE_TIMEOUT_SECONDS="120",
    )
    url = f"http://127.0.0.1:{port}"
    service.wait(lambda: _up(url), 60, "the capped API")
    mine, other = service.key("team-capped"), service.key("team-not-capped")
    # The streams go to a worker of demo-b that stays live while frozen (a long liveness
    # TTL): frozen with the usual 3 s its streams would end as worker_lost, freeing slots.
    held = start_worker(service, "demo-b", BATCHWRIGHT_ONLINE_WORKER_TTL_SECONDS="600")
    long = {"model": "demo-b", "prompt": "Once", "max_tokens": 400, "stream": True,
            "logit_bias": {str(EOS): -100}}  # fmt: skip
    short = {"model": "demo", "prompt": "Hi", "max_tokens": 2}
    path = url + "/v1/completions"
    as_mine, as_other = {"Authorization": f"Bearer {mine}"}, {"Authorization": f"Bearer {other}"}
    firsts: list[str] = []
    leave = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", path, json=long, headers=as_mine, timeout=120) as response:
            # The iterator is kept: dropped, its generator's close would close the
            # connection, and the server would end the stream as the client gone.
            lines = response.iter_lines()
            firsts.append(next(lines))
            leave.wait(120)

    readers = [threading.Thread(target=stream) for _ in range(2)]
    client = redis.Redis.from_url(REDIS)
    prefix = f"{service.env['BATCHWRIGHT_QUEUE']}:online"
    before = set(client.scan_iter(f"{prefix}:events:*"))

    def both_streaming() -> bool:
        # Each request's events as the worker adds them (the API trims what it has read,
        # so the count ever added): its Started and a first Delta.
        keys = set(client.scan_iter(f"{prefix}:events:*")) - before
        added = [_added(client, k) for k in keys]
        return len(added) == 2 and all(n >= 2 for n in added)

    # Both requests wait for the frozen worker, which then runs a slice at a time until
    # both have a first delta in Redis, and stays frozen while the clients read it:
    # neither stream can end (and give its slot back) before the third request comes.
    # Stepped until the clients had read their first lines, the worker could run a
    # stream's 400 tokens out while a first line was on its way through the API.
    held.proc.signal_group(signal.SIGSTOP)
    try:
        try:
            for t in readers:
                t.start()
            service.wait(lambda: client.llen(f"{prefix}:pending:demo-b") == 2, 60, "both queued")
            step_until(held, both_streaming)
            service.wait(lambda: len(firsts) == 2, 60, "both first chunks read")
            assert all(f.startswith('data: {"id"') for f in firsts), firsts  # two streams
            third = httpx.post(path, json=short, headers=as_mine, timeout=60)
            assert third.status_code == 429, third.text
            assert int(third.headers["retry-after"]) >= 1
            assert "concurrent requests" in third.json()["error"]["message"]
        finally:
            held.proc.signal_group(signal.SIGCONT)
            leave.set()
            for t in readers:
                t.join(120)
        others = httpx.post(path, json=short, headers=as_other, timeout=60)
        assert others.status_code == 200, others.text
    finally:
        # Whatever failed: later tests of this module need demo-b without a worker.
        api.stop()
        held.proc.stop()
        # Its liveness would outlast the test: it is gone, say so (as its TTL would).
        for name in client.scan_iter(f"{prefix}:worker:*"):
            if client.get(name) == b'["demo-b"]':
                client.delete(name)


def _response(sock: socket.socket) -> bytes:
    """One whole HTTP response (head and Content-Length body): a recv may hold either part."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, data  # closed before the head was whole
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        chunk = sock.recv(4096)
        assert chunk, data
        body += chunk
    return head + b"\r\n\r\n" + body


def _added(client: redis.Redis, key: bytes) -> int:
    try:
        return int(client.xinfo_stream(key)["entries-added"])
    except redis.ResponseError:  # gone since it was listed
        return 0


def test_a_huge_schema_is_refused_before_any_check(service: Service, worker: Worker) -> None:
    # 6,000 properties: before, the metaschema check held the event loop, then the compile
    # held the worker for many seconds; now a 400 at once naming the bound.
    props = {f"p{i}": {"type": "string"} for i in range(6000)}
    fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": {"type": "object",
           "properties": props}}}  # fmt: skip
    r = _post(service, service.key("team-schema"),
              {"model": "demo", "prompt": "x", "response_format": fmt})  # fmt: skip
    assert r.status_code == 400, r.text
    assert "more than 5000 properties" in r.json()["error"]["message"]


def _nested(levels: int, leaf: Any) -> Any:
    value = leaf
    for _ in range(levels):
        value = {"type": "object", "properties": {"a": value}}
    return value


def test_deep_nesting_is_a_400_and_leaves_a_usage_row(service: Service, worker: Worker) -> None:
    key = service.key("team-deep")
    deep = _nested(100, {"type": "string"})
    deep_schema = {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep}}
    r = _post(service, key, {"model": "demo", "prompt": "x", "response_format": deep_schema})
    assert r.status_code == 400 and "nests deeper" in r.json()["error"]["message"], r.text
    const: Any = 1
    for _ in range(300):
        const = [const]
    array = {"type": "array", "const": const}
    shallow = {"type": "json_schema", "json_schema": {"name": "c", "schema": array}}
    r = _post(service, key, {"model": "demo", "prompt": "x", "response_format": shallow})
    assert r.status_code == 400, r.text
    metadata: Any = "x"
    for _ in range(300):
        metadata = {"k": metadata}
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "metadata": metadata}
    r = _post(service, key, chat, "/v1/chat/completions")
    assert r.status_code == 400, r.text
    service.wait(lambda: len(usage_rows(service, "team-deep")) == 3, 60, "3 usage rows")


def test_refusals_only_the_worker_can_make_keep_their_status_when_streamed(
    service: Service, worker: Worker
) -> None:
    client = service.client(service.key("team-refused"))
    # Before: a 200 stream, then an error event (the SDK raised a bare APIError).
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="demo", prompt="Hello", max_tokens=10**6, stream=True)
    assert too_long.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as vocab:
        client.completions.create(model="demo", prompt=[10**7], max_tokens=2, stream=True)
    assert vocab.value.body["param"] == "prompt"  # type: ignore[index]
    bad = {"type": "json_schema", "json_schema": {"name": "b", "schema": {
        "type": "string", "pattern": "(?<=a)b"}}}  # fmt: skip
    with pytest.raises(openai.BadRequestError) as grammar:
        client.completions.create(model="demo", prompt="x", max_tokens=2, stream=True,
                                  echo=True, extra_body={"response_format": bad})  # fmt: skip
    assert grammar.value.body["param"] == "response_format"  # type: ignore[index]


def test_a_prompt_too_large_for_the_context_and_long_stops_are_refused_at_the_api(
    service: Service, worker: Worker
) -> None:
    key = service.key("team-sizes")
    prefix = f"{service.env['BATCHWRIGHT_QUEUE']}:online"
    client = redis.Redis.from_url(REDIS)
    service.wait(lambda: client.exists(f"{prefix}:limits:demo"), 30, "the model's limits")
    # A prompt no tokenization of the demo model's vocabulary can fit in its context.
    r = _post(service, key, {"model": "demo", "prompt": "y" * 900_000, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "bytes" in r.json()["error"]["message"]
    r = _post(service, key, {"model": "demo", "prompt": "x", "stop": ["s" * 300_000]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text


def test_metrics_and_capacity_are_not_public_and_label_registry_names_only(
    service: Service, worker: Worker
) -> None:
    key = service.key("team-metrics")
    for i in range(3):
        r = _post(service, key, {"model": f"no-such-model-{i}-" + "z" * 5000, "prompt": "x"})
        assert r.status_code == 404
    assert httpx.get(service.api_url + "/metrics").status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.get(service.api_url + "/metrics", headers=wrong).status_code == 401
    assert "models" not in httpx.get(service.api_url + "/readyz").json()
    assert httpx.get(service.api_url + "/readyz", headers=METRICS).json()["models"]["demo"] == 1
    # The listener of its own (BATCHWRIGHT_METRICS_PORT, set for this stack).
    text = httpx.get(f"http://127.0.0.1:{service.env['BATCHWRIGHT_METRICS_PORT']}/metrics").text
    assert "batchwright_online_requests_total" in text
    assert "no-such-model" not in text and len(text) < 1_000_000


def test_no_event_stream_outlives_its_ttl_after_a_client_leaves(
    service: Service, worker: Worker
) -> None:
    # Before: the API deleted a left request's stream, the worker's next deltas re-created
    # it without a TTL, and it stayed in Redis for good.
    key = service.key("team-leaves-ttl")
    body = {"model": "demo", "prompt": "Once", "max_tokens": 400, "stream": True,
            "logit_bias": {str(EOS): -100}}  # fmt: skip
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.stream(
        "POST", service.api_url + "/v1/completions", json=body, headers=auth, timeout=120
    ) as response:
        first = next(response.iter_lines())
    request_id = first.split('"id":"', 1)[1].split('"', 1)[0]
    client = redis.Redis.from_url(REDIS)
    prefix = f"{service.env['BATCHWRIGHT_QUEUE']}:online"
    in_flight = 'batchwright_worker_rows_in_flight{model="demo"}'
    service.wait(lambda: worker.metric(in_flight) == 0.0, 120, "no rows in flight")
    events = f"{prefix}:events:{request_id}"
    assert not client.exists(events) or client.ttl(events) > 0
    assert all(client.ttl(k) > 0 for k in client.scan_iter(f"{prefix}:events:*"))


def test_rate_limit_headers_and_retry_after_always_come(service: Service, worker: Worker) -> None:
    key = service.key("team-headers")
    r = _post(service, key, {"model": "demo", "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200
    for name in ("limit", "remaining", "reset"):
        assert f"x-ratelimit-{name}-requests" in r.headers, r.headers
        assert f"x-ratelimit-{name}-tokens" in r.headers, r.headers
    unserved = _post(service, key, {"model": "demo-b", "prompt": "Hi"})
    assert unserved.status_code == 503 and int(unserved.headers["retry-after"]) >= 1


def test_a_path_cannot_forge_a_log_line(service: Service) -> None:
    host, port = service.api_url.removeprefix("http://").split(":")
    forged = "FORGED-LOG-LINE-33"
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            f"POST /v1/x%0A{forged}%20ERROR HTTP/1.1\r\nHost: x\r\n".encode()
            + f"Authorization: Bearer {service.key('team-log')}\r\n".encode()
            + b"Content-Length: 1000\r\n\r\n{"
        )
    api = service.procs[0]
    service.wait(lambda: forged in api.output(), 30, "the log line")
    assert not any(line.startswith(forged) for line in api.output().splitlines())


def test_an_idle_connection_outlives_a_five_second_poll(service: Service) -> None:
    # uvicorn's default closed idle connections after 5 s, just as a client polling every
    # 5 s sent its next request.
    host, port = service.api_url.removeprefix("http://").split(":")
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        assert _response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(7)  # idle, past uvicorn's default keep-alive: the stimulus itself
        sock.sendall(request)
        assert _response(sock).startswith(b"HTTP/1.1 200")


def test_redis_unreachable_is_a_503_not_a_500(service: Service, worker: Worker) -> None:
    # An API process whose Redis is gone (a port nothing listens on).
    port = _free_port()
    dead = f"redis://127.0.0.1:{_free_port()}/0"
    api = service.spawn(
        "api-no-redis",
        ["serve", "--port", str(port)],
        BATCHWRIGHT_BROKER_URL=dead,
        BATCHWRIGHT_METRICS_PORT="0",  # the stack's API has that port
    )
    url = f"http://127.0.0.1:{port}"
    service.wait(lambda: _up(url), 60, "the second API")
    try:
        r = httpx.post(url + "/v1/completions", json={"model": "demo", "prompt": "x"},
                       headers={"Authorization": f"Bearer {service.key('team-noredis')}"},
                       timeout=60)  # fmt: skip
        assert r.status_code == 503 and r.json()["error"]["code"] == "broker_unavailable", r.text
        assert int(r.headers["retry-after"]) >= 1
    finally:
        api.stop()


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_stream_whose_redis_connections_die_still_ends_with_done(
    service: Service, worker: Worker
) -> None:
    import psutil

    key = service.key("team-redis-kill")
    body = {"model": "demo", "prompt": "Once", "max_tokens": 400, "stream": True,
            "logit_bias": {str(EOS): -100}}  # fmt: skip
    api_pid = service.procs[0].popen.pid
    redis_port = int(REDIS.rsplit(":", 1)[1].split("/")[0])
    admin = redis.Redis.from_url(REDIS)
    auth = {"Authorization": f"Bearer {key}"}
    url = service.api_url + "/v1/completions"
    with httpx.stream("POST", url, json=body, headers=auth, timeout=120) as response:
        lines = response.iter_lines()
        seen = [next(lines) for _ in range(3)]
        # Every connection of the API process to Redis, closed by Redis (no other client's).
        for conn in psutil.Process(api_pid).net_connections(kind="tcp"):
            if conn.raddr and conn.raddr.port == redis_port:
                admin.client_kill_filter(_type=None, addr=f"{conn.laddr.ip}:{conn.laddr.port}")
        seen += list(lines)
    data = [ln for ln in seen if ln]
    assert data[-1] == "data: [DONE]", data[-3:]
    # The connections Redis closed that wait in the API's pool are replaced when next
    # used, not answered with a 503: requests at once, to take every pooled connection.
    plain = {**body, "stream": False, "max_tokens": 4}
    with ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(lambda _: httpx.post(url, json=plain, headers=auth, timeout=120), range(8))
        )
    assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers]
