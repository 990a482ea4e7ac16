"""Hardening, round 2 (issue 9): poison inputs answered as the client's mistakes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
from openai import OpenAI

from tests.conftest import create_database, drop_database
from tests.helpers import jsonl, line, read_jsonl, submit, wait_batch


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return dict(err)


def _line_error(errs: list[dict[str, Any]], custom_id: str) -> dict[str, Any]:
    [err] = [e for e in errs if e["custom_id"] == custom_id]
    assert err["response"]["status_code"] == 400, err
    return dict(err["response"]["body"]["error"])


def test_thousand_level_nesting_is_that_lines_400(client: OpenAI) -> None:
    """Below the JSON parser's limit but beyond what validation can handle: the line is a
    400 naming the problem and the batch moves on (it used to stay `validating`)."""
    nested = (
        '{"custom_id":"deep","method":"POST","url":"/v1/completions","body":{"model":"demo",'
        '"prompt":"x","user":' + "[" * 1000 + "]" * 1000 + "}}\n"
    )
    data = jsonl([line("ok-1")]) + nested.encode() + jsonl([line("ok-2")])
    done = wait_batch(client, submit(client, data).id, timeout=120)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    err = _line_error(read_jsonl(client, done.error_file_id), "deep")
    assert err["param"] in ("user", "body"), err
    assert "Line 2" in err["message"] or "user" in err["message"], err


def test_unicode_digit_logit_bias_fails_only_its_line(client: OpenAI) -> None:
    rows = [line(f"ok-{i}") for i in range(5)] + [line("bad", {"logit_bias": {"²": 1}})]
    done = wait_batch(client, submit(client, jsonl(rows)).id, timeout=120)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (5, 1)
    assert _line_error(read_jsonl(client, done.error_file_id), "bad")["param"] == "logit_bias"


def test_sequences_cap_names_both_numbers(client: OpenAI) -> None:
    rows = [line("ok"), line("huge", {"prompt": ["p"] * 200, "n": 10})]
    done = wait_batch(client, submit(client, jsonl(rows)).id, timeout=120)
    assert done.request_counts.failed == 1
    err = _line_error(read_jsonl(client, done.error_file_id), "huge")
    assert err["param"] == "n" and err["code"] == "too_many_sequences"
    assert "2000" in err["message"] and "256" in err["message"], err


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input_file_id": "\u0000"}, "input_file_id"),
        ({"input_file_id": "file-x\u0000y"}, "input_file_id"),
        ({"completion_window": "24h\u0000"}, "completion_window"),
        ({"endpoint": "/v1/completions\u0000"}, "endpoint"),
        ({"metadata": {"k": "v\u0000"}}, "metadata"),
        ({"metadata": {"k\u0000": "v"}}, "metadata"),
    ],
)
def test_nul_in_batch_fields_is_a_400(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    full = {
        "input_file_id": "file-abc",
        "endpoint": "/v1/completions",
        "completion_window": "24h",
        **body,
    }
    err = _error(http.post("/v1/batches", json=full), 400)
    assert err["param"] == param, err


def test_unauthenticated_bad_body_is_401(api_url: str) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}):
        resp = httpx.post(
            api_url + "/v1/batches",
            content=b"{not json",
            headers={"content-type": "application/json", **headers},
        )
        _error(resp, 401)
        resp = httpx.post(api_url + "/v1/batches", json={"input_file_id": 5}, headers=headers)
        _error(resp, 401)


def _multipart_counts(env: dict[str, str]) -> tuple[int, int]:
    with psycopg.connect(env["BATCHWRIGHT_DATABASE_URL"]) as conn:
        files = conn.execute("SELECT count(*) FROM files").fetchone()
        chunks = conn.execute("SELECT count(*) FROM file_chunks").fetchone()
    assert files and chunks
    return int(files[0]), int(chunks[0])


def test_truncated_multipart_stores_nothing(
    http: httpx.Client, service_env: dict[str, str]
) -> None:
    before = _multipart_counts(service_env)
    payload = jsonl([line("a"), line("b")])
    body = (
        b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--b\r\nContent-Disposition: form-data; name="file"; filename="t.jsonl"\r\n\r\n'
        + payload[:-14]  # no closing boundary: the body was cut short
    )
    resp = http.post(
        "/v1/files", content=body, headers={"content-type": "multipart/form-data; boundary=b"}
    )
    assert "closing boundary" in _error(resp, 400)["message"]
    assert _multipart_counts(service_env) == before


def test_streamed_form_fields_are_limited(http: httpx.Client) -> None:
    def body() -> Iterator[bytes]:  # chunked: no Content-Length to refuse up front
        for i in range(100_000):
            yield b'--b\r\nContent-Disposition: form-data; name="f%d"\r\n\r\n' % i
            yield b"x" * 1000 + b"\r\n"
        yield b"--b--\r\n"

    resp = http.post(
        "/v1/files", content=body(), headers={"content-type": "multipart/form-data; boundary=b"}
    )
    assert "Too many form fields" in _error(resp, 400)["message"]


def test_streamed_body_over_the_limit_is_413(
    http: httpx.Client, service_env: dict[str, str]
) -> None:
    limit = int(service_env["BATCHWRIGHT_MAX_UPLOAD_BYTES"])

    def body() -> Iterator[bytes]:
        # Bytes after the closing boundary (an epilogue) belong to no field and no file:
        # only the total request size bounds them.
        yield b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="e.jsonl"\r\n\r\n'
        yield jsonl([line("a")]) + b"\r\n--b--\r\n"
        chunk = b"e" * (1024 * 1024)
        for _ in range(limit // len(chunk) + 2):
            yield chunk

    resp = http.post(
        "/v1/files", content=body(), headers={"content-type": "multipart/form-data; boundary=b"}
    )
    _error(resp, 413)


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "batchwright.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_keys_revoke_unknown_id_is_one_line(service_env: dict[str, str]) -> None:
    out = _cli(service_env, "keys", "revoke", "key_doesnotexist")
    assert out.returncode == 1
    assert "Traceback" not in out.stderr + out.stdout
    assert "key_doesnotexist" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_keys_create_before_db_upgrade_says_what_to_do(service_env: dict[str, str]) -> None:
    url = create_database("bw_empty")
    try:
        out = _cli({**service_env, "BATCHWRIGHT_DATABASE_URL": url}, "keys", "create")
        assert out.returncode == 1
        assert "Traceback" not in out.stderr + out.stdout
        assert "batchwright db upgrade" in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    finally:
        drop_database(url)
