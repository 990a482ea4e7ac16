"""The CLI client end to end: every `batchwright files|batches|models|keys` command as a
subprocess against the live test service (API, worker and sweeper started by conftest)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Proc, _free_port, create_key
from tests.helpers import jsonl, line

pytestmark = pytest.mark.timeout(600)


class CLI:
    def __init__(self, api_url: str, api_key: str, env: dict[str, str]) -> None:
        self.env = {**env, "OPENAI_BASE_URL": api_url + "/v1", "OPENAI_API_KEY": api_key}

    def __call__(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "batchwright.cli", *args],
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
        return done

    def json(self, *args: str) -> Any:
        done = self(*args, "--json")
        assert done.returncode == 0, done.stdout + done.stderr
        return json.loads(done.stdout)


@pytest.fixture(scope="module")
def cli(api_url: str, api_key: str, worker: Proc, service_env: dict[str, str]) -> CLI:
    return CLI(api_url, api_key, service_env)


def test_version_and_models(cli: CLI) -> None:
    done = cli("--version")
    assert done.returncode == 0 and done.stdout.startswith("batchwright ")
    assert {m["id"] for m in cli.json("models", "list")} >= {"demo", "demo-b"}
    table = cli("models", "list")
    assert table.returncode == 0 and "demo" in table.stdout


def test_files_commands(cli: CLI, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    data = jsonl([line("f1"), line("f2")])
    src.write_bytes(data)
    file = cli.json("files", "upload", str(src))
    assert file["filename"] == "in.jsonl" and file["bytes"] == len(data)
    assert file["purpose"] == "batch"
    assert file["id"] in {f["id"] for f in cli.json("files", "list", "--purpose", "batch")}
    assert file["id"] in cli("files", "list").stdout
    assert cli.json("files", "get", file["id"])["bytes"] == len(data)

    target = tmp_path / "copy.jsonl"
    done = cli("files", "download", file["id"], "--output", str(target))
    assert done.returncode == 0 and target.read_bytes() == data
    assert cli("files", "download", file["id"]).stdout.encode() == data

    assert cli.json("files", "delete", file["id"])["deleted"] is True
    gone = cli("files", "get", file["id"])
    assert gone.returncode == 1
    assert gone.stderr.startswith("error: not found (404)") and len(gone.stderr.splitlines()) == 1


def test_batch_submit_wait_list_get_download(cli: CLI, worker: Proc, tmp_path: Path) -> None:
    src = tmp_path / "batch.jsonl"
    src.write_bytes(jsonl([line(f"b{i}") for i in range(6)] + [line("x", {"temperature": 9})]))
    batch = cli.json("batches", "submit", str(src), "--metadata", "team=a", "--wait")
    assert batch["status"] == "completed" and batch["metadata"] == {"team": "a"}
    assert batch["request_counts"] == {"total": 7, "completed": 6, "failed": 1}

    assert batch["id"] in {b["id"] for b in cli.json("batches", "list")}
    assert batch["id"] in cli("batches", "list").stdout
    assert cli.json("batches", "get", batch["id"])["output_file_id"] == batch["output_file_id"]
    shown = cli("batches", "get", batch["id"])
    assert "completed" in shown.stdout and "team=a" in shown.stdout

    out, errors = tmp_path / "o.jsonl", tmp_path / "e.jsonl"
    done = cli("batches", "download", batch["id"], "--output", str(out), "--errors", str(errors))
    assert done.returncode == 0, done.stderr
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == [
        f"b{i}" for i in range(6)
    ]
    assert [json.loads(x)["custom_id"] for x in errors.read_text().splitlines()] == ["x"]
    # The model is loaded by now: its load left no progress bar in the worker's log.
    assert "Loading weights" not in worker.output()


def test_watch_follows_a_running_batch_to_its_end(cli: CLI, tmp_path: Path) -> None:
    src = tmp_path / "watch.jsonl"
    src.write_bytes(jsonl([line(f"w{i}", {"max_tokens": 16}) for i in range(40)]))
    batch = cli.json("batches", "submit", str(src))
    assert batch["status"] in ("validating", "in_progress")
    done = cli("batches", "watch", batch["id"], "--interval", "0.3")
    assert done.returncode == 0, done.stderr
    assert "completed" in done.stdout and "40/40 done, 0 failed" in done.stdout
    assert "tok/s" in done.stderr  # the live line, drawn on stderr


def test_cancel(cli: CLI, tmp_path: Path, worker: Proc) -> None:
    src = tmp_path / "cancel.jsonl"
    src.write_bytes(jsonl([line(f"c{i}", {"max_tokens": 64}) for i in range(300)]))
    # The worker frozen from submit to cancel: the batch cannot be done before the cancel
    # lands, however fast the engine (an engine host kept warm ran all 300 lines first).
    worker.signal_group(signal.SIGSTOP)
    try:
        batch = cli.json("batches", "submit", str(src))
        cancelled = cli.json("batches", "cancel", batch["id"])
    finally:
        worker.signal_group(signal.SIGCONT)
    assert cancelled["status"] in ("cancelling", "cancelled")
    watched = cli("batches", "watch", batch["id"], "--interval", "0.3")
    assert watched.returncode == 1 and "cancelled" in watched.stdout  # not completed: exit 1


def test_clear_one_line_errors(cli: CLI, tmp_path: Path, service_env: dict[str, str]) -> None:
    refused = cli("batches", "list", "--base-url", f"http://127.0.0.1:{_free_port()}")
    assert refused.returncode == 1
    assert "connection refused" in refused.stderr and len(refused.stderr.splitlines()) == 1

    bad_key = cli("batches", "list", OPENAI_API_KEY="sk-bw-wrong")
    assert bad_key.returncode == 1
    assert bad_key.stderr.startswith("error: the service refused the API key (401)")

    missing = cli("batches", "get", "batch_doesnotexist")
    assert missing.returncode == 1 and "not found (404)" in missing.stderr

    src = tmp_path / "x.jsonl"
    src.write_bytes(jsonl([line("m")]))
    bad_arg = cli("batches", "submit", str(src), "--metadata", "novalue")
    assert bad_arg.returncode == 2 and "is not key=value" in bad_arg.stderr
    assert cli("batches", "submit", str(tmp_path / "nope.jsonl")).returncode == 2


def test_keys_list(cli: CLI) -> None:
    keys = cli.json("keys", "list")["data"]
    assert "team-a" in {k["project"] for k in keys}
    assert all(k["prefix"].startswith("sk-bw-") for k in keys)
    assert "team-a" in cli("keys", "list").stdout


def test_models_list_shows_live_workers(cli: CLI) -> None:
    listed = {m["id"]: m for m in cli.json("models", "list")}
    assert listed["demo"]["live_workers"] >= 1
    shown = cli("models", "list")
    assert "live workers" in shown.stdout
    [row] = [r for r in shown.stdout.splitlines() if "│ demo " in r]
    assert f"│ {listed['demo']['live_workers']} " in row, shown.stdout


def test_complete_over_the_rate_limit_fails_at_once(cli: CLI, service_env: dict[str, str]) -> None:
    """The SDK would wait out Retry-After (up to a minute) in silence and then succeed:
    the command says 429 in one line and exits 1 instead."""
    key = create_key(service_env, "cli-limited")
    assert cli("projects", "set", "cli-limited", "--rpm", "1").returncode == 0
    first = cli("complete", "Once upon", "--model", "demo", "--max-tokens", "2",
                OPENAI_API_KEY=key)  # fmt: skip
    assert first.returncode == 0, first.stderr
    for extra in ([], ["--stream"]):
        over = cli("complete", "Once upon", "--model", "demo", *extra, OPENAI_API_KEY=key)
        assert over.returncode == 1 and over.stdout == ""
        [line_] = over.stderr.strip().splitlines()
        assert line_.startswith("error: over the project's rate limit (429): Rate limit reached")
        assert "Please try again in" in line_


def test_ctrl_c_of_submit_wait_says_the_batch_goes_on(cli: CLI, tmp_path: Path) -> None:
    src = tmp_path / "long.jsonl"
    src.write_bytes(jsonl([line(f"k{i}", {"max_tokens": 256}) for i in range(400)]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchwright.cli", "batches", "submit", str(src), "--wait"],
        env=cli.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As from a terminal: a test run started in the background (`.ci/run &`) passes
        # SIGINT on ignored, and Python then never raises KeyboardInterrupt.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stderr is not None
    watching = proc.stderr.readline()  # the first line it prints, once the batch exists
    assert watching.startswith("watching batch_"), watching
    batch_id = watching.split()[1]
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert f"stopped watching {batch_id}; the batch goes on at the server" in rest
    assert "Traceback" not in rest
    # It does go on: it is still there, not cancelled by the Ctrl-C.
    assert cli.json("batches", "get", batch_id)["status"] in ("validating", "in_progress")
    cli("batches", "cancel", batch_id)
