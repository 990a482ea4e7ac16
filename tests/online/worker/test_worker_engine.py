"""Online requests served by a real worker's engine host, beside batches: streamed and
not, ahead of a running batch (whose lines are preempted and still come out unchanged,
once each), and when the worker holding a request dies before or after its first token."""

from __future__ import annotations

import io
import json
import signal
import threading
from typing import Any

import httpx
import openai
import pytest
import redis

from batchwright.relay.worker_side import WorkerRelay
from tests.conftest import REDIS, _free_port
from tests.shared.conftest import Service

EOS_BAN = {"0": -100}  # the demo tokenizer's <|endoftext|> is id 0


def _metric(port: int, name: str, labels: str = 'model="demo"') -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(f"{name}{{{labels}}} "):
            return float(line.split()[-1])
    return 0.0


def _worker(svc: Service, **env: str) -> tuple[Any, int]:
    port = _free_port()
    (proc,) = svc.workers(["--models", "demo"], BATCHWRIGHT_WORKER_METRICS_PORT=str(port), **env)
    return proc, port


def _live(svc: Service, model: str = "demo") -> int:
    client = redis.Redis.from_url(REDIS)
    queue = svc.env["BATCHWRIGHT_QUEUE"]
    members = client.smembers(f"{queue}:online:serving:{model}")
    return sum(1 for w in members if client.exists(f"{queue}:online:worker:{w.decode()}"))


def test_streamed_and_plain_requests_agree(svc: Service) -> None:
    _worker(svc)
    client = svc.client(svc.key("team-engine"))
    svc.wait(lambda: _live(svc), what="a live worker")
    body: dict[str, Any] = {
        "model": "demo",
        "prompt": ["Once upon a time", "The sea"],
        "max_tokens": 12,
        "temperature": 0.9,
        "seed": 3,
        "n": 2,
        "logprobs": 2,
        "echo": True,
        "logit_bias": EOS_BAN,
    }
    plain = client.completions.create(**body)
    chunks = list(client.completions.create(**body, stream=True))
    for choice in plain.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
        tokens = [t for c in mine if c.logprobs for t in c.logprobs.tokens or []]
        assert choice.logprobs is not None and tokens == choice.logprobs.tokens
    assert {c.id for c in chunks} == {chunks[0].id}


def _batch_lines(n: int, longer: int = 0) -> bytes:
    lines = []
    for i in range(n):
        body: dict[str, Any] = {
            "model": "demo",
            "prompt": f"Line {i}: the story goes",
            "max_tokens": 24 + longer + i % 9,
            "logit_bias": EOS_BAN,
            "temperature": 0 if i % 3 == 0 else 1.0,
            "seed": i,
        }
        if i % 4 == 1:
            body |= {"n": 2, "logprobs": 1}
        if i % 5 == 2:
            body |= {"stop": ["e t"]}
        lines.append({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
                      "body": body})  # fmt: skip
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def _run_batch(client: Any, data: bytes) -> dict[str, Any]:
    f = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    return client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
    )


def _output(client: Any, batch_id: str, svc: Service) -> dict[str, Any]:
    done = svc.wait(
        lambda: (b := client.batches.retrieve(batch_id)).status == "completed" and b,
        what="the batch completed",
    )
    out: dict[str, Any] = {}
    for line in client.files.content(done.output_file_id).text.splitlines():
        row = json.loads(line)
        assert row["custom_id"] not in out, f"{row['custom_id']} written twice"
        body = row["response"]["body"]
        out[row["custom_id"]] = (
            [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]],
            body["usage"],
        )
    return out


def test_online_requests_go_ahead_of_a_running_batch_and_change_none_of_its_lines(
    svc: Service,
) -> None:
    """A batch fills the rows; online requests preempt its lines; the batch's output is
    the same, line for line, as without them; no line is written twice or lost."""
    # Alive while frozen below (its liveness key outlasts the freeze).
    proc, port = _worker(svc, BATCHWRIGHT_ONLINE_WORKER_TTL_SECONDS="600")
    client = svc.client(svc.key("team-preempt"))
    data = _batch_lines(60, longer=40)
    alone = _output(client, _run_batch(client, data).id, svc)
    batch = _run_batch(client, data)
    svc.wait(lambda: _metric(port, "batchwright_worker_rows_in_flight") >= 16, what="full rows")
    # Frozen with its rows full of batch lines (dozens still waiting), the worker finds the
    # online requests queued at its next step, however fast its engine is.
    proc.signal_group(signal.SIGSTOP)
    answers: list[Any] = []

    def ask(i: int) -> None:
        answers.append(
            client.completions.create(
                model="demo", prompt=f"Online {i}", max_tokens=8, temperature=0
            )
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    try:
        for t in threads:
            t.start()
        pending = f"{svc.env['BATCHWRIGHT_QUEUE']}:online:pending:demo"
        svc.wait(lambda: redis.Redis.from_url(REDIS).llen(pending) == 6, 60, "six queued")
    finally:
        proc.signal_group(signal.SIGCONT)
    for t in threads:
        t.join()
    assert len(answers) == 6 and all(a.choices[0].finish_reason for a in answers)
    assert _metric(port, "batchwright_worker_preemptions_total") > 0
    assert _output(client, batch.id, svc) == alone


def _relay_id(svc: Service, proc: Any) -> str:
    """The worker's id in the relay (host:pid)."""
    queue = svc.env["BATCHWRIGHT_QUEUE"]
    members = redis.Redis.from_url(REDIS).smembers(f"{queue}:online:serving:demo")
    return next(w.decode() for w in members if w.decode().endswith(f":{proc.popen.pid}"))


def _events(svc: Service, request_id: str) -> list[dict[str, Any]]:
    queue = svc.env["BATCHWRIGHT_QUEUE"]
    entries = redis.Redis.from_url(REDIS).xrange(f"{queue}:online:events:{request_id}")
    return [json.loads(fields[b"e"]) for _, fields in entries]


def _in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_a_worker_killed_before_the_first_token_is_replaced_unseen(svc: Service) -> None:
    """The request sits in the dead worker's taken list, as its taker left it; another
    worker of the model gets it from the reaper, and the client sees one whole answer."""
    (first, _), (second, _) = _worker(svc), _worker(svc)
    client = svc.client(svc.key("team-reap"))
    svc.wait(lambda: _live(svc) == 2, what="two live workers")
    dead = _relay_id(svc, first)
    for proc in (first, second):
        proc.signal_group(signal.SIGSTOP)  # neither takes anything now (both still live)
    body = {"model": "demo", "prompt": "Hello there", "max_tokens": 10, "temperature": 0}
    asking, got = _in_thread(lambda: list(client.completions.create(**body, stream=True)))
    # Taken as the frozen worker's taker takes (the relay's own script, its worker id).
    relay = WorkerRelay(redis.Redis.from_url(REDIS), svc.env["BATCHWRIGHT_QUEUE"], dead, ["demo"])
    taken = svc.wait(lambda: relay.take(timeout=0.2), what="the request taken")
    first.signal_group(signal.SIGKILL)
    second.signal_group(signal.SIGCONT)
    asking.join(timeout=120)
    (chunks,) = got
    assert not isinstance(chunks, Exception), chunks
    assert {c.id for c in chunks} == {taken.request.id}
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == client.completions.create(**body).choices[0].text


def test_a_worker_killed_after_the_first_token_ends_the_stream_with_an_error(
    svc: Service,
) -> None:
    worker, _ = _worker(svc)
    client = svc.client(svc.key("team-kill"))
    svc.wait(lambda: _live(svc), what="a live worker")
    stream = client.completions.create(
        model="demo",
        prompt="A long story",
        max_tokens=400,
        temperature=0,
        logit_bias=EOS_BAN,
        stream=True,
    )
    it = iter(stream)
    first = next(it)
    assert first.choices and first.choices[0].text
    worker.signal_group(signal.SIGKILL)
    with pytest.raises(openai.APIError) as caught:
        for _ in it:
            pass
    assert "stopped before it finished" in str(caught.value)


def test_a_plain_request_whose_worker_dies_is_answered_by_another(svc: Service) -> None:
    """Not streamed, the client has seen nothing when the worker dies mid-generation: the
    request runs again on another worker and the client gets the Completion."""
    (first, _), (second, port) = _worker(svc), _worker(svc)
    client = svc.client(svc.key("team-retry"))
    svc.wait(lambda: _live(svc) == 2, what="two live workers")
    second.signal_group(signal.SIGSTOP)
    body = {
        "model": "demo",
        "prompt": "A long story",
        "max_tokens": 400,
        "temperature": 0,
        "logit_bias": EOS_BAN,
    }
    asking, got = _in_thread(lambda: client.completions.create(**body))
    queue = svc.env["BATCHWRIGHT_QUEUE"]
    r = redis.Redis.from_url(REDIS)
    taken_key = f"{queue}:online:taken:{_relay_id(svc, first)}"
    raw = svc.wait(lambda: r.lrange(taken_key, 0, -1), what="the first worker took it")
    request_id = json.loads(raw[0])["id"]
    svc.wait(lambda: _events(svc, request_id), what="the first worker started it")
    first.signal_group(signal.SIGKILL)
    second.signal_group(signal.SIGCONT)
    asking.join(timeout=180)
    (answer,) = got
    assert not isinstance(answer, Exception), answer
    assert answer.id == request_id and answer.usage.completion_tokens == 400
    # The second worker answered it (it was frozen until the first died).
    done = 'model="demo",outcome="completed"'
    assert _metric(port, "batchwright_worker_lines_total", done) == 1
