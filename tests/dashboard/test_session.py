"""The dashboard's session (issue 22, item 8): a cookie that is no API key and ends with its
session or its key, Secure behind HTTPS, pages that cannot be framed, and downloads named
by the base name of what was uploaded."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import psycopg
import pytest

from tests.conftest import Proc, _free_port, create_key
from tests.dashboard.test_pages import sign_in
from tests.helpers import jsonl, line

COOKIE = "bw_dashboard_session"


def _signed_in(web: httpx.Client) -> bool:
    resp = web.get("/dashboard/batches")
    assert resp.status_code in (200, 303), resp
    return resp.status_code == 200


def _session_rows(env: dict[str, str]) -> list[tuple[str, str]]:
    with psycopg.connect(env["BATCHWRIGHT_DATABASE_URL"]) as conn:
        return [(r[0], r[1]) for r in conn.execute("SELECT id, key_id FROM dashboard_sessions")]


def test_cookie_is_a_session_not_the_key(api_url: str, service_env: dict[str, str]) -> None:
    key = create_key(service_env, "dash-session")
    web = sign_in(api_url, key)
    token = web.cookies[COOKIE]
    assert key not in token and token not in key
    assert _signed_in(web)
    # Stored hashed: the database holds the token's sha256, never the token.
    rows = _session_rows(service_env)
    assert (hashlib.sha256(token.encode()).hexdigest(),) in [(r[0],) for r in rows]
    assert all(token not in r[0] for r in rows)
    # The key itself in the cookie opens nothing.
    with httpx.Client(base_url=api_url, cookies={COOKIE: key}) as forged:
        assert not _signed_in(forged)
    with httpx.Client(base_url=api_url, cookies={"bw_dashboard_key": key}) as old_style:
        assert not _signed_in(old_style)
    # Signing out ends the session: the same cookie opens nothing after.
    web.post("/dashboard/logout")
    with httpx.Client(base_url=api_url, cookies={COOKIE: token}) as replay:
        assert not _signed_in(replay)
    web.close()


def test_session_ends_with_its_key_and_its_time(api_url: str, service_env: dict[str, str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "batchwright.cli", "keys", "create", "--project", "dash-end"],
        env=service_env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    key = out.stdout.strip().splitlines()[-1]
    key_id = next(w for w in (out.stdout + out.stderr).split() if w.startswith("key_"))
    web, other = sign_in(api_url, key), sign_in(api_url, key)
    assert _signed_in(web) and _signed_in(other)
    with psycopg.connect(service_env["BATCHWRIGHT_DATABASE_URL"], autocommit=True) as conn:
        conn.execute(
            "UPDATE dashboard_sessions SET expires_at = %s WHERE id = %s",
            (int(time.time()) - 1, hashlib.sha256(web.cookies[COOKIE].encode()).hexdigest()),
        )
    assert not _signed_in(web)  # expired
    assert _signed_in(other)
    subprocess.run(
        [sys.executable, "-m", "batchwright.cli", "keys", "revoke", key_id],
        env=service_env, check=True, capture_output=True,
    )  # fmt: skip
    assert not _signed_in(other)  # revoked with its key
    assert key_id not in [r[1] for r in _session_rows(service_env)]
    web.close()
    other.close()


def test_pages_cannot_be_framed(api_url: str, service_env: dict[str, str]) -> None:
    web = sign_in(api_url, create_key(service_env, "dash-frame"))
    for path in ("/dashboard/login", "/dashboard/batches", "/dashboard/service"):
        resp = web.get(path)
        assert resp.status_code == 200
        policy = resp.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in policy and "script-src 'self'" in policy
        assert "unsafe-inline" not in policy
        assert resp.headers["x-frame-options"] == "DENY"
        assert resp.headers["x-content-type-options"] == "nosniff"
        assert 'style="' not in resp.text and "<script>" not in resp.text  # all from 'self'
    assert web.get("/dashboard/static/dashboard.js").headers["x-content-type-options"] == "nosniff"
    assert web.get("/healthz").headers["x-content-type-options"] == "nosniff"
    web.close()


@pytest.fixture(scope="module")
def untrusting_api(
    service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """An API that trusts no proxy at 127.0.0.1 (BATCHWRIGHT_FORWARDED_ALLOW_IPS)."""
    port = _free_port()
    log = tmp_path_factory.mktemp("untrusting") / "api.log"
    env = {**service_env, "BATCHWRIGHT_FORWARDED_ALLOW_IPS": "10.9.9.9"}
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
    yield url
    proc.stop()


def test_cookie_is_secure_behind_a_trusted_https_proxy(
    api_url: str, untrusting_api: str, service_env: dict[str, str]
) -> None:
    key = create_key(service_env, "dash-secure")
    https = {"X-Forwarded-Proto": "https"}

    def cookie(url: str, headers: dict[str, str]) -> str:
        resp = httpx.post(url + "/dashboard/login", data={"key": key}, headers=headers)
        assert resp.status_code == 303, resp.text
        return resp.headers["set-cookie"].lower()

    trusted = cookie(api_url, https)  # the default trusts a proxy on 127.0.0.1
    assert "; secure" in trusted and "httponly" in trusted and "samesite=strict" in trusted
    assert "; secure" not in cookie(api_url, {})  # plain HTTP
    assert "; secure" not in cookie(untrusting_api, https)  # a proxy it does not trust


@pytest.mark.parametrize(
    "name, sent",
    [
        ("../../etc/passwd", 'attachment; filename="passwd"'),
        ("..\\..\\boot.ini", 'attachment; filename="boot.ini"'),
        ("日本語.jsonl", "attachment; filename=\"___.jsonl\"; filename*=UTF-8''"
         "%E6%97%A5%E6%9C%AC%E8%AA%9E.jsonl"),
    ],
)  # fmt: skip
def test_downloads_send_the_base_name(
    api_url: str, service_env: dict[str, str], http: httpx.Client, name: str, sent: str
) -> None:
    data = jsonl([line("a")])
    boundary = "bnd"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="'.encode()
        + name.encode()
        + b'"\r\n\r\n'
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )
    resp = http.post(
        "/v1/files",
        content=body,
        headers={"content-type": f"multipart/form-data; boundary={boundary}"},
    )
    assert resp.status_code == 200, resp.text
    file_id = resp.json()["id"]
    web = sign_in(api_url, http.headers["authorization"].split()[1])
    for got in (
        web.get(f"/dashboard/files/{file_id}/download"),
        http.get(f"/v1/files/{file_id}/content"),
    ):
        assert got.status_code == 200, got.text
        assert got.headers["content-disposition"] == sent
        assert got.content == data
    web.close()
