"""HTTP surface: auth, tenancy, files, pagination, and bad requests answered with a 4xx."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import httpx
import pytest
from openai import NotFoundError, OpenAI

from tests.conftest import create_key
from tests.helpers import jsonl, line, read_jsonl, submit, wait_batch


def _envelope(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    return dict(err)


def test_auth_required(api_url: str) -> None:
    _envelope(httpx.get(api_url + "/v1/batches"), 401)
    _envelope(httpx.get(api_url + "/v1/files", headers={"Authorization": "Bearer nope"}), 401)
    _envelope(httpx.get(api_url + "/v1/files", headers={"Authorization": "Basic abc"}), 401)


def test_revoked_key_is_refused(api_url: str, service_env: dict[str, str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "batchwright.cli", "keys", "create", "--project", "revoke-me"],
        env=service_env,
        check=True,
        capture_output=True,
        text=True,
    )
    secret = out.stdout.strip().splitlines()[-1]
    key_id = out.stderr.split("key id:")[1].split()[0]
    auth = {"Authorization": f"Bearer {secret}"}
    assert httpx.get(api_url + "/v1/batches", headers=auth).status_code == 200
    subprocess.run(
        [sys.executable, "-m", "batchwright.cli", "keys", "revoke", key_id],
        env=service_env,
        check=True,
        capture_output=True,
    )
    _envelope(httpx.get(api_url + "/v1/batches", headers=auth), 401)


def test_keys_are_stored_hashed(api_key: str, service_env: dict[str, str]) -> None:
    import psycopg

    with psycopg.connect(service_env["BATCHWRIGHT_DATABASE_URL"]) as conn:
        hashes = [r[0] for r in conn.execute("SELECT key_hash FROM api_keys")]
    assert api_key not in hashes and all(len(h) == 64 for h in hashes)


def test_other_projects_ids_are_404(client: OpenAI, api_url: str, other_key: str) -> None:
    batch = submit(client, jsonl([line("t1")]))
    other = OpenAI(base_url=api_url + "/v1", api_key=other_key, max_retries=0)
    with pytest.raises(NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(NotFoundError):
        other.files.retrieve(batch.input_file_id)
    with pytest.raises(NotFoundError):
        other.files.content(batch.input_file_id)
    with pytest.raises(NotFoundError):
        other.batches.cancel(batch.id)
    with pytest.raises(NotFoundError):
        other.files.delete(batch.input_file_id)
    with pytest.raises(NotFoundError):
        other.batches.create(
            input_file_id=batch.input_file_id, endpoint="/v1/completions", completion_window="24h"
        )
    assert batch.id not in [b.id for b in other.batches.list().data]
    assert batch.input_file_id not in [f.id for f in other.files.list().data]
    wait_batch(client, batch.id)


def test_file_crud_and_pagination(client: OpenAI) -> None:
    data = jsonl([line("f")])
    ids = [client.files.create(file=(f"f{i}.jsonl", data), purpose="batch").id for i in range(3)]
    got = client.files.retrieve(ids[0])
    assert (got.filename, got.purpose, got.bytes, got.object) == (
        "f0.jsonl",
        "batch",
        len(data),
        "file",
    )
    assert client.files.content(ids[1]).content == data
    page = client.files.list(limit=2, order="desc", purpose="batch")
    assert len(page.data) == 2 and page.has_more
    assert [f.id for f in page.data] == [ids[2], ids[1]]
    nxt = client.files.list(limit=2, order="desc", after=page.data[-1].id, purpose="batch")
    assert nxt.data[0].id == ids[0]
    deleted = client.files.delete(ids[2])
    assert deleted.deleted and deleted.id == ids[2]
    with pytest.raises(NotFoundError):
        client.files.retrieve(ids[2])


def test_batch_list_pagination(client: OpenAI) -> None:
    made = [submit(client, jsonl([line(f"p{i}")])).id for i in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2]
    assert first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == made[0]
    for batch_id in made:
        wait_batch(client, batch_id)


def test_models_and_health(http: httpx.Client) -> None:
    models = http.get("/v1/models").json()
    assert {m["id"] for m in models["data"]} == {"demo", "demo-b"}
    assert http.get("/healthz").json() == {"status": "ok"}
    ready = http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["database"] == "ok"
    assert ready.json()["broker"] == "ok"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"endpoint": "/v1/completions", "completion_window": "24h"}, "input_file_id"),
        (
            {"input_file_id": "file-x", "endpoint": "/v1/responses", "completion_window": "24h"},
            "endpoint",
        ),
        (
            {"input_file_id": "file-x", "endpoint": "/v1/completions", "completion_window": "1h"},
            "completion_window",
        ),
        (
            {"input_file_id": 5, "endpoint": "/v1/completions", "completion_window": "24h"},
            "input_file_id",
        ),
        (
            {
                "input_file_id": "f",
                "endpoint": "/v1/completions",
                "completion_window": "24h",
                "metadata": {f"k{i}": "v" for i in range(17)},
            },
            "metadata",
        ),
        (
            {
                "input_file_id": "f",
                "endpoint": "/v1/completions",
                "completion_window": "24h",
                "metadata": {"k": "v" * 513},
            },
            "metadata",
        ),
        (
            {
                "input_file_id": "f",
                "endpoint": "/v1/completions",
                "completion_window": "24h",
                "surprise": 1,
            },
            "surprise",
        ),
    ],
)
def test_create_batch_rejects(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    err = _envelope(http.post("/v1/batches", json=body), 400)
    assert err["param"] == param, err


def test_create_batch_unknown_file_is_404(http: httpx.Client) -> None:
    body = {"input_file_id": "file-nope", "endpoint": "/v1/completions", "completion_window": "24h"}
    _envelope(http.post("/v1/batches", json=body), 404)


def test_output_file_is_not_a_batch_input(client: OpenAI, http: httpx.Client) -> None:
    done = wait_batch(client, submit(client, jsonl([line("o")])).id)
    body = {
        "input_file_id": done.output_file_id,
        "endpoint": "/v1/completions",
        "completion_window": "24h",
    }
    assert _envelope(http.post("/v1/batches", json=body), 400)["param"] == "input_file_id"


def test_cancel_finished_batch_is_409(client: OpenAI, http: httpx.Client) -> None:
    done = wait_batch(client, submit(client, jsonl([line("x")])).id)
    assert done.status == "completed"
    _envelope(http.post(f"/v1/batches/{done.id}/cancel"), 409)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/batches/abc",
        "/v1/batches/batch_%00x",
        "/v1/files/%00",
        "/v1/files/" + "x" * 5000,
        "/v1/files/file-nope/content",
        "/v1/batches?after=nope",
        "/v1/files?after=%00",
    ],
)
def test_odd_ids_are_4xx(http: httpx.Client, path: str) -> None:
    resp = http.get(path)
    assert 400 <= resp.status_code < 500, resp.text
    _envelope(resp, resp.status_code)


@pytest.mark.parametrize(
    ("query", "param"), [("limit=0", "limit"), ("limit=101", "limit"), ("limit=abc", "limit")]
)
def test_list_limits(http: httpx.Client, query: str, param: str) -> None:
    assert _envelope(http.get(f"/v1/batches?{query}"), 400)["param"] == param


def test_bad_json_bodies(http: httpx.Client) -> None:
    _envelope(
        http.post("/v1/batches", content=b"{nope", headers={"content-type": "application/json"}),
        400,
    )
    deep = b"[" * 100_000 + b"]" * 100_000
    resp = http.post("/v1/batches", content=deep, headers={"content-type": "application/json"})
    assert 400 <= resp.status_code < 500, resp.text
    _envelope(http.post("/v1/batches", json=[1, 2]), 400)


def test_upload_mistakes(http: httpx.Client) -> None:
    files = {"file": ("a.jsonl", jsonl([line("a")]))}
    assert (
        _envelope(http.post("/v1/files", files=files, data={"purpose": "fine-tune"}), 400)["param"]
        == "purpose"
    )
    assert _envelope(http.post("/v1/files", files=files), 400)["param"] == "purpose"
    assert _envelope(http.post("/v1/files", data={"purpose": "batch"}), 400)["param"] == "file"
    _envelope(http.post("/v1/files", content=b"plain", headers={"content-type": "text/plain"}), 400)
    _envelope(
        http.post(
            "/v1/files",
            content=b"--x\r\ngarbage",
            headers={"content-type": "multipart/form-data; boundary=x"},
        ),
        400,
    )


def test_upload_over_limit_keeps_nothing(http: httpx.Client, service_env: dict[str, str]) -> None:
    import psycopg

    def counts() -> tuple[int, int]:
        with psycopg.connect(service_env["BATCHWRIGHT_DATABASE_URL"]) as conn:
            files = conn.execute("SELECT count(*) FROM files").fetchone()
            chunks = conn.execute("SELECT count(*) FROM file_chunks").fetchone()
        assert files and chunks
        return int(files[0]), int(chunks[0])

    before = counts()
    limit = int(service_env["BATCHWRIGHT_MAX_UPLOAD_BYTES"])

    def body() -> Any:
        # Streamed with no Content-Length, so the limit must bite while reading.
        yield b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
        chunk = b"x" * (1024 * 1024)
        for _ in range(limit // len(chunk) + 2):
            yield chunk
        yield b"\r\n--b--\r\n"

    resp = http.post(
        "/v1/files", content=body(), headers={"content-type": "multipart/form-data; boundary=b"}
    )
    assert _envelope(resp, 413)["code"] == "file_too_large"
    assert counts() == before


def test_awkward_but_valid_input(client: OpenAI) -> None:
    """BOM, CRLF, blank lines and NUL inside a prompt are all processed, line numbers kept."""
    rows = [line("bom"), line("crlf"), line("nul", {"prompt": "a\u0000b"})]
    data = b"\xef\xbb\xbf" + json.dumps(rows[0]).encode() + b"\r\n\r\n\n"
    data += json.dumps(rows[1]).encode() + b"\r\n" + json.dumps(rows[2]).encode()
    done = wait_batch(client, submit(client, data).id)
    assert done.status == "completed", done
    out = read_jsonl(client, done.output_file_id)
    assert [o["custom_id"] for o in out] == ["bom", "crlf", "nul"]


def test_non_utf8_fails_with_line_number(client: OpenAI) -> None:
    data = jsonl([line("a")]) + b'{"custom_id": "\xff\xfe", "method": "POST"}\n'
    done = wait_batch(client, submit(client, data).id)
    assert done.status == "failed"
    assert (done.errors.data[0].code, done.errors.data[0].line) == ("invalid_json_line", 2)


def test_deeply_nested_line(client: OpenAI) -> None:
    nested = (
        '{"custom_id":"d","method":"POST","url":"/v1/completions","body":{"model":"demo",'
        '"prompt":"x","user":' + "[" * 5000 + "]" * 5000 + "}}"
    )
    done = wait_batch(client, submit(client, jsonl([line("ok")]) + nested.encode()).id)
    assert done.status == "failed"
    assert (done.errors.data[0].code, done.errors.data[0].line) == ("invalid_json_line", 2)


def test_wrong_types_are_per_line(client: OpenAI) -> None:
    rows = [
        line("a", {"max_tokens": "ten"}),
        line("b", {"stop": 5}),
        line("c", {"n": -1}),
        line("d", {"echo": "yes"}),
        line("e"),
    ]
    done = wait_batch(client, submit(client, jsonl(rows)).id)
    assert done.status == "completed"
    errs = {
        e["custom_id"]: e["response"]["body"]["error"]["param"]
        for e in read_jsonl(client, done.error_file_id)
    }
    assert errs == {"a": "max_tokens", "b": "stop", "c": "n", "d": "echo"}


def test_ten_megabyte_line(client: OpenAI) -> None:
    rows = [line("big", {"prompt": "word " * 2_000_000}), line("small")]
    done = wait_batch(client, submit(client, jsonl(rows)).id, timeout=300)
    assert done.status == "completed"
    errs = read_jsonl(client, done.error_file_id)
    assert [e["custom_id"] for e in errs] == ["big"]
    assert errs[0]["response"]["status_code"] == 400
    assert [o["custom_id"] for o in read_jsonl(client, done.output_file_id)] == ["small"]


def test_second_key_same_project(service_env: dict[str, str], api_url: str, client: OpenAI) -> None:
    """Two keys of one project see the same batches."""
    batch = submit(client, jsonl([line("shared")]))
    again = OpenAI(base_url=api_url + "/v1", api_key=create_key(service_env, "team-a"))
    assert again.batches.retrieve(batch.id).id == batch.id
    wait_batch(client, batch.id)


def test_output_lines_survive_splitlines(client: OpenAI) -> None:
    """Text with U+2028, U+2029 and NEL (line breaks to str.splitlines) stays one line."""
    prompt = "a\u2028b\u2029c\x85d\x1ce"
    rows = [line("breaks", {"prompt": prompt, "echo": True, "max_tokens": 0}), line("next")]
    done = wait_batch(client, submit(client, jsonl(rows)).id)
    assert done.status == "completed"
    text = client.files.content(done.output_file_id).text
    out = [json.loads(x) for x in text.splitlines()]
    assert [o["custom_id"] for o in out] == ["breaks", "next"]
    assert out[0]["response"]["body"]["choices"][0]["text"] == prompt
