"""Hostile input (issue 22, item 7): each a 400/413 naming the parameter or the body, or a
line error; never a 500, never a whole batch failed for one line, never a traceback.

Some tests use an API process of their own, with a small JSON body cap and a log to read."""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.conftest import Proc, _free_port
from tests.helpers import jsonl, line, read_jsonl, submit, wait_batch

CAP = 64 * 1024
LEFT = "the client left before sending its whole body"


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return dict(err)


@pytest.fixture(scope="module")
def own_api(
    service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Proc]]:
    port = _free_port()
    log = tmp_path_factory.mktemp("hostile") / "api.log"
    env = {**service_env, "BATCHWRIGHT_MAX_JSON_BODY_BYTES": str(CAP)}
    proc = Proc([sys.executable, "-m", "batchwright.cli", "serve", "--port", str(port)], env, log)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            assert time.monotonic() < end, proc.output()
            time.sleep(0.2)
    yield url, proc
    proc.stop()


def _raw(url: str, head: str, body: bytes = b"", close_after: bool = False) -> bytes:
    """Send a request head (and maybe part of a body) on a raw socket; the answer (head
    and body), or b"" when `close_after` (the client leaves without reading)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        if close_after:
            return b""
        answer = b""
        while b"\r\n\r\n" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
        top, _, rest = answer.partition(b"\r\n\r\n")
        length = int(top.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        while len(rest) < length and (chunk := sock.recv(65536)):
            rest += chunk
        return top + b"\r\n\r\n" + rest


@pytest.mark.parametrize(
    "raw, param",
    [
        (b'{"input_file_id": "file-\\ud800"}', "input_file_id"),
        (b'{"metadata": {"k": "v\\udfff"}}', "metadata"),
        (b'{"metadata": {"\\ud800": "v"}}', "metadata"),
        (b'{"completion_window": "\\udbff24h"}', "completion_window"),
        (b'{"\\ud800": 1}', None),  # a key pydantic cannot name: the body is
    ],
)
def test_lone_surrogates_are_a_400(http: httpx.Client, raw: bytes, param: str | None) -> None:
    base = b'"input_file_id": "file-abc", "endpoint": "/v1/completions", "completion_window": "24h"'
    body = b"{" + base + b", " + raw[1:-1] + b"}"  # later keys win
    resp = http.post("/v1/batches", content=body, headers={"content-type": "application/json"})
    err = _error(resp, 400)
    assert err["param"] == param, err
    assert "surrogate" in err["message"], err


def test_long_multipart_boundary_is_a_400(http: httpx.Client) -> None:
    boundary = "b" * 300
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f"--{boundary}--\r\n"
    ).encode()
    resp = http.post(
        "/v1/files",
        content=body,
        headers={"content-type": f"multipart/form-data; boundary={boundary}"},
    )
    assert "boundary" in _error(resp, 400)["message"].lower()


def test_huge_max_tokens_fails_only_its_line(client: OpenAI) -> None:
    rows = [
        line("ok-1"),
        line("int64", {"max_tokens": 2**63 - 1}),
        line("n2", {"n": 2, "max_tokens": 2**62}),
        line("float", {"max_tokens": 1e12}),
        line("ok-2"),
    ]
    done = wait_batch(client, submit(client, jsonl(rows)).id, timeout=180)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 3)
    errors = {e["custom_id"]: e for e in read_jsonl(client, done.error_file_id)}
    assert set(errors) == {"int64", "n2", "float"}
    for err in errors.values():
        assert err["response"]["status_code"] == 400
        assert err["response"]["body"]["error"]["param"] == "max_tokens", err


@pytest.mark.parametrize("key", [None, "Bearer sk-bw-wrong"])
def test_body_of_a_stranger_is_not_read(own_api: tuple[str, Proc], key: str | None) -> None:
    """A 300 MiB Content-Length and no body sent: the key is checked first, so the 401
    comes back at once instead of after a body the server would wait for."""
    url, _ = own_api
    auth = f"Authorization: {key}\n" if key else ""
    answer = _raw(
        url,
        "POST /v1/batches HTTP/1.1\nHost: x\nContent-Type: application/json\n"
        f"{auth}Content-Length: {300 * 2**20}\n",
    )
    assert answer.startswith(b"HTTP/1.1 401"), answer[:300]
    assert b"invalid_api_key" in answer


def test_json_body_over_the_cap_is_a_413(own_api: tuple[str, Proc], api_key: str) -> None:
    url, _ = own_api
    auth = f"Authorization: Bearer {api_key}\n"
    declared = _raw(
        url,
        "POST /v1/batches HTTP/1.1\nHost: x\nContent-Type: application/json\n"
        f"{auth}Content-Length: {300 * 2**20}\n",
    )
    assert declared.startswith(b"HTTP/1.1 413"), declared[:300]
    # Chunked: no length to judge by; refused once the cap is passed.
    pieces = [b'{"metadata": ['] + [b'"' + b"x" * 8190 + b'",'] * (2 * CAP // 8192)
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces)
    streamed = _raw(
        url,
        "POST /v1/batches HTTP/1.1\nHost: x\nContent-Type: application/json\n"
        f"{auth}Transfer-Encoding: chunked\n",
        chunks,
    )
    assert streamed.startswith(b"HTTP/1.1 413"), streamed[:300]
    body = json.loads(streamed.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_too_large"
    assert "request body" in body["error"]["message"]
    # Under the cap the body reaches the endpoint as sent.
    ok = httpx.post(
        url + "/v1/batches",
        json={"input_file_id": "file-nope", "endpoint": "/v1/completions",
              "completion_window": "24h", "metadata": {"k": "v" * 500}},
        headers={"Authorization": f"Bearer {api_key}"},
    )  # fmt: skip
    assert "file-nope" in _error(ok, 404)["message"]


def test_client_leaving_mid_body_leaves_no_traceback(
    own_api: tuple[str, Proc], api_key: str
) -> None:
    url, proc = own_api
    auth = f"Authorization: Bearer {api_key}\n"
    _raw(
        url,
        f"POST /v1/batches HTTP/1.1\nHost: x\nContent-Type: application/json\n{auth}"
        "Content-Length: 1000\n",
        b'{"input_file_id": "fi',
        close_after=True,
    )
    _raw(
        url,
        f"POST /v1/files HTTP/1.1\nHost: x\n{auth}"
        "Content-Type: multipart/form-data; boundary=b\nContent-Length: 100000\n",
        b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{"cu',
        close_after=True,
    )
    end = time.monotonic() + 120
    while proc.output().count(LEFT) < 2:
        assert "Traceback" not in proc.output(), proc.output()
        assert time.monotonic() < end, proc.output()
        time.sleep(0.1)
    log = proc.output()
    assert "Traceback" not in log and "unhandled error" not in log, log
    assert "POST /v1/batches: " + LEFT in log and "POST /v1/files: " + LEFT in log, log
