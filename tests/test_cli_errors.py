"""What a newcomer's ordinary mistakes print (issue 36): one line naming the problem and the
fix, never a traceback, and nothing started or removed on the way."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.conftest import PG_ADMIN, Proc, _free_port, create_database, drop_database


def cli(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("BATCHWRIGHT_", "OPENAI_"))}
    done = subprocess.run(
        [sys.executable, "-m", "batchwright.cli", *args],
        env={**base, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    return done


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["serve", "worker", "beat"])
def test_service_commands_refuse_to_start_without_both_urls(command: str, tmp_path: Path) -> None:
    # Both forgotten (a second terminal), then only the broker.
    neither = cli(command, BATCHWRIGHT_HOME=str(tmp_path))
    assert neither.returncode == 2
    line = one_line(neither)
    assert f"`batchwright {command}` needs BATCHWRIGHT_DATABASE_URL and" in line
    assert "not set: BATCHWRIGHT_DATABASE_URL, BATCHWRIGHT_BROKER_URL" in line
    half = cli(
        command,
        BATCHWRIGHT_HOME=str(tmp_path),
        BATCHWRIGHT_DATABASE_URL="postgresql://postgres@127.0.0.1:5432/x",
    )
    assert half.returncode == 2 and one_line(half).endswith(
        "not set: BATCHWRIGHT_BROKER_URL (export both in this shell, as in the README's "
        '"Running the service"; `batchwright run FILE` needs neither)'
    )
    # Nothing was made on the embedded SQLite on the way.
    assert not (tmp_path / "batchwright.sqlite3").exists()


def test_readyz_fails_without_a_broker(pg_url: str, tmp_path: Path) -> None:
    """The API started some other way (uvicorn itself) with no broker is not ready."""
    from batchwright.db.migrate import upgrade_head

    upgrade_head(pg_url)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWRIGHT_")}
    env |= {"BATCHWRIGHT_DATABASE_URL": pg_url, "BATCHWRIGHT_HOME": str(tmp_path)}
    args = ["-m", "uvicorn", "batchwright.app:create_app", "--factory", "--port", str(port)]
    proc = Proc([sys.executable, *args], env, tmp_path / "api.log")
    try:
        url = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 60
        while True:
            try:
                httpx.get(url + "/healthz", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < end, proc.output()
                time.sleep(0.2)
        ready = httpx.get(url + "/readyz", timeout=10)
        assert ready.status_code == 503
        body = ready.json()
        assert body["status"] == "unavailable" and body["database"] == "ok"
        assert body["broker"] == "not configured (BATCHWRIGHT_BROKER_URL)"
        # Error envelopes of the API and of the online endpoint: no deprecation warnings
        # in the log (FastAPI deprecated ORJSONResponse; one warning per place it was used).
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        for path in ("/v1/completions", "/v1/chat/completions"):
            answer = httpx.post(url + path, timeout=10)  # 503 here: no broker, no relay
            assert answer.status_code in (401, 503) and answer.json()["error"]["message"]
    finally:
        proc.stop()
    assert "DeprecationWarning" not in proc.output(), proc.output()


def _missing_database() -> str:
    return PG_ADMIN.rsplit("/", 1)[0] + f"/bw_missing_{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize(
    "command",
    [("db", "upgrade"), ("keys", "create"), ("keys", "list"), ("projects", "list"),
     ("webhooks", "list")],
)  # fmt: skip
def test_a_database_that_does_not_exist(command: tuple[str, ...]) -> None:
    url = _missing_database()
    name = url.rsplit("/", 1)[1]
    done = cli(*command, BATCHWRIGHT_DATABASE_URL=url)
    assert done.returncode == 1
    line = one_line(done)
    assert line.startswith(f'error: the database "{name}" on 127.0.0.1:5432 does not exist')
    assert f"`createdb -h 127.0.0.1 -p 5432 -U postgres {name}`" in line, line
    assert "then `batchwright db upgrade`" in line


def test_a_database_without_tables_and_one_that_is_down(pg_url: str) -> None:
    empty = create_database("bw_empty")
    name = empty.rsplit("/", 1)[1]
    try:
        done = cli("keys", "create", BATCHWRIGHT_DATABASE_URL=empty)
        assert done.returncode == 1 and done.stdout == ""
        assert one_line(done).endswith("has no tables yet: run `batchwright db upgrade` first")
        upgraded = cli("db", "upgrade", BATCHWRIGHT_DATABASE_URL=empty)
        assert upgraded.returncode == 0, upgraded.stderr
        assert f"database at head: postgresql://postgres@127.0.0.1:5432/{name}" in upgraded.stdout
    finally:
        drop_database(empty)
    down = cli(
        "db",
        "upgrade",
        BATCHWRIGHT_DATABASE_URL=f"postgresql://postgres@127.0.0.1:{_free_port()}/x",
    )
    assert down.returncode == 1
    assert "(connection refused); is Postgres running?" in one_line(down)


def test_keys_revoke_never_echoes_a_secret(service_env: dict[str, str]) -> None:
    env = {k: v for k, v in service_env.items() if k.startswith("BATCHWRIGHT_")}
    made = cli("keys", "create", "--project", "revoker", **env)
    secret = made.stdout.strip()
    assert secret.startswith("sk-bw-")
    wrong = cli("keys", "revoke", secret, **env)
    assert wrong.returncode == 1 and secret not in wrong.stdout + wrong.stderr
    assert "pass the key_… id that `batchwright keys list` shows" in one_line(wrong)
    key_id = one_line(made).removeprefix("key id: ")
    assert cli("keys", "revoke", key_id, **env).stdout.strip() == f"revoked {key_id}"


def test_run_checks_its_output_paths_before_any_work(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(
        '{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
        '"body": {"model": "demo", "prompt": "x", "max_tokens": 2}}\n'
    )
    old_errors = tmp_path / "in.errors.jsonl"
    old_errors.write_text("from an earlier run\n")
    home = tmp_path / "home"
    done = cli("run", str(src), "--output", "missing_dir/out.jsonl", cwd=tmp_path,
               BATCHWRIGHT_HOME=str(home))  # fmt: skip
    assert done.returncode == 1
    assert one_line(done) == (
        "error: --output missing_dir/out.jsonl: the folder missing_dir does not exist"
    )
    # Nothing ran and nothing was removed: no model built, no state, the old file kept.
    assert not home.exists() and old_errors.read_text() == "from an earlier run\n"
    same = cli("run", str(src), "--output", str(src), BATCHWRIGHT_HOME=str(home))
    assert same.returncode == 1 and "is the input file itself" in one_line(same)


def test_messages_with_brackets_are_printed_whole(tmp_path: Path) -> None:
    """Rich markup: the registry's hint quotes TOML in brackets; it must reach the terminal."""
    models = tmp_path / "models.toml"
    models.write_text('[models.qwen2.5-0.5b]\npath = "/models/q"\n')
    done = cli("worker", BATCHWRIGHT_MODELS_FILE=str(models), COLUMNS="300")
    assert done.returncode == 2
    assert '(a name with dots needs quotes: [models."qwen2.5-0.5b"])' in one_line(done)


@pytest.mark.parametrize(
    ("args", "usage"),
    [(("run",), " run [OPTIONS] FILE"),
     (("batches", "submit"), " batches submit [OPTIONS] PATH"),
     (("keys", "revoke"), " keys revoke [OPTIONS] KEY_ID")],
)  # fmt: skip
def test_help_pages_read_plainly(args: tuple[str, ...], usage: str) -> None:
    done = cli(*args, "--help", COLUMNS="120")
    assert done.returncode == 0 and usage in done.stdout, done.stdout
    assert "<bool>" not in done.stdout and "{" not in done.stdout


def test_operator_commands_say_when_they_use_the_embedded_sqlite(tmp_path: Path) -> None:
    """A fresh shell without the export: `keys list` would read an empty SQLite file."""
    done = cli("keys", "list", BATCHWRIGHT_HOME=str(tmp_path))
    assert done.returncode == 1
    note, error = done.stderr.strip().splitlines()
    assert note.startswith("note: BATCHWRIGHT_DATABASE_URL is not set: using the embedded SQLite")
    assert "for a service's database export BATCHWRIGHT_DATABASE_URL" in error
